"""Who may take part in a run, and what a peer's records and messages must look like to be believed.

- **Swarm key** (``p2ptrain keygen``, ``--swarm-key FILE``): 32 random bytes shared by the run's operators. A run
  with a key is *private*. Each peer derives the swarm's secret from it and:
  - tags every DHT record it stores with an HMAC of (key, subkey, value, expiration), and refuses, when asked to
    store or when reading, any record without a valid tag (``SwarmKeyValidator``): a peer without the key can
    write nothing the run reads (progress, shard cursors, matchmaking and donor declarations);
  - proves in every averaging request (join a group, ask for state) that it holds the key, with a token bound to
    its own peer id (``SwarmAuth.token``), which libp2p authenticates (the connection is encrypted and keyed by the
    peer's identity): another peer cannot replay it.
  A run without a key is *open*: anyone who reaches a peer may join, and the daemons say so at start.
- **Signed records** (always, private or open): a record whose subkey is a peer id (progress records,
  hivemind's averager and donor declarations) must be signed by that peer's libp2p identity key, checked against
  the peer id itself (``PeerSignatureValidator``): one peer cannot pose as another or rewrite another's records.
- **Message sizes**: ``limit_stream_messages`` caps one message on a libp2p stream (hivemind reads whatever
  length a peer announces), so a peer cannot make another buffer gigabytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import struct
import time
from pathlib import Path
from typing import Optional

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import MSGPackSerializer

from p2ptrain.keyfiles import SWARM_KEY_BYTES, KeyFileError, generate_swarm_key, load_swarm_key  # noqa: F401

logger = logging.getLogger(__name__)


TOKEN_BYTES = 16
MAX_STREAM_MESSAGE_BYTES = 64 * 1024 * 1024
"""the largest message p2ptrain accepts on a libp2p stream: a part of the all-reduce is at most a few MiB"""


@dataclasses.dataclass(frozen=True)
class SwarmAuth:
    """A swarm's admission rule: with a swarm key, only peers that prove they hold it; without one, everyone."""

    secret: Optional[bytes] = None
    """HMAC(swarm key, a fixed label); None for an open swarm"""

    @classmethod
    def from_key(cls, swarm_key: Optional[bytes]) -> "SwarmAuth":
        if swarm_key is None:
            return cls()
        return cls(hmac.new(swarm_key, b"p2ptrain swarm v1", hashlib.sha256).digest())

    @property
    def private(self) -> bool:
        return self.secret is not None

    def token(self, peer_id: PeerID) -> bytes:
        """Proof that the holder of ``peer_id`` has the swarm key (empty for an open swarm)."""
        if self.secret is None:
            return b""
        return hmac.new(self.secret, b"admit " + peer_id.to_bytes(), hashlib.sha256).digest()[:TOKEN_BYTES]

    def admits(self, peer_id: PeerID, token: object) -> bool:
        if self.secret is None:
            return True
        return isinstance(token, bytes) and hmac.compare_digest(token, self.token(peer_id))


# ---- DHT records --------------------------------------------------------------------------------------------------

class _RateLimitedWarning:
    """At most one warning per ``period_s`` for a kind of refusal, counting the ones in between."""

    def __init__(self, period_s: float = 30.0):
        self.period_s, self._last, self._suppressed = period_s, 0.0, 0

    def __call__(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last < self.period_s:
            self._suppressed += 1
            return
        more = f" (and {self._suppressed} more since the last report)" if self._suppressed else ""
        self._last, self._suppressed = now, 0
        logger.warning(message + more)


def _record_bytes(record: DHTRecord) -> bytes:
    return MSGPackSerializer.dumps(dataclasses.astuple(record))


class SwarmKeyValidator(RecordValidatorBase):
    """Every record carries ``MAGIC + HMAC(swarm secret, record)[:16]`` at the end of its value; records without a
    valid tag are refused (stored by nobody who holds the key, and ignored when read)."""

    MAGIC = b"p2k1"

    def __init__(self, auth: SwarmAuth):
        assert auth.secret is not None, "an open swarm has no swarm key to check"
        self._secret = auth.secret
        self._warn = _RateLimitedWarning()

    def _tag(self, record: DHTRecord) -> bytes:
        return hmac.new(self._secret, _record_bytes(record), hashlib.sha256).digest()[:TOKEN_BYTES]

    def sign_value(self, record: DHTRecord) -> bytes:
        return record.value + self.MAGIC + self._tag(record)

    @classmethod
    def split(cls, value: bytes) -> Optional[tuple]:
        """(value without the tag, tag) if ``value`` ends with a tag, else None."""
        suffix = len(cls.MAGIC) + TOKEN_BYTES
        if len(value) >= suffix and value[-suffix:-TOKEN_BYTES] == cls.MAGIC:
            return value[:-suffix], value[-TOKEN_BYTES:]
        return None

    def strip_value(self, record: DHTRecord) -> bytes:
        parts = self.split(record.value)
        return parts[0] if parts else record.value

    def validate(self, record: DHTRecord) -> bool:
        parts = self.split(record.value)
        if parts and hmac.compare_digest(parts[1], self._tag(dataclasses.replace(record, value=parts[0]))):
            return True
        self._warn("refused a DHT record not tagged with this peer's swarm key: its writer holds no key or another "
                   "one (every peer of the swarm needs the same --swarm-key file)")
        return False

    @property
    def priority(self) -> int:
        return 20  # outermost: checked first, added last

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, SwarmKeyValidator) and other._secret == self._secret


_RSA_PADDING = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=32)


def load_identity(path: str | Path) -> rsa.RSAPrivateKey:
    """The RSA private key of a libp2p identity file (hivemind's format: a protobuf ``PrivateKey``)."""
    proto = crypto_pb2.PrivateKey.FromString(Path(path).read_bytes())
    key = serialization.load_der_private_key(proto.data, password=None) if proto.key_type == crypto_pb2.RSA else None
    if not isinstance(key, rsa.RSAPrivateKey):
        raise KeyFileError(f"--identity {path} is not an RSA key; let p2ptrain create the file (remove it)")
    return key


def peer_id_of(public_key_der: bytes) -> PeerID:
    """The libp2p peer id of an RSA public key (DER SubjectPublicKeyInfo), as p2pd computes it."""
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=public_key_der).SerializeToString()
    return PeerID(b"\x12\x20" + hashlib.sha256(encoded).digest())


def _subkey_peer(record: DHTRecord) -> Optional[bytes]:
    """The peer id a record's subkey names (a sha2-256 multihash), or None if it names none."""
    if not record.subkey:
        return None
    try:
        subkey = MSGPackSerializer.loads(record.subkey)
    except Exception:
        return None
    if isinstance(subkey, bytes) and len(subkey) == 34 and subkey[:2] == b"\x12\x20":
        return subkey
    return None


class PeerSignatureValidator(RecordValidatorBase):
    """A record whose subkey is a peer id must be signed by that peer's identity key. The value ends with
    ``signature + public key (DER) + len(public key) as 2 bytes + MAGIC``; the signature (RSA-PSS, SHA-256) covers
    key, subkey, value and expiration, so it cannot be replayed with another expiration or under another key."""

    MAGIC = b"p2s1"

    def __init__(self, identity: rsa.RSAPrivateKey):
        self._key = identity
        self._public_der = identity.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        self.peer_id = peer_id_of(self._public_der)
        self._warn = _RateLimitedWarning()

    def sign_value(self, record: DHTRecord) -> bytes:
        if _subkey_peer(record) != self.peer_id.to_bytes():
            return record.value
        signature = self._key.sign(_record_bytes(record), _RSA_PADDING, hashes.SHA256())
        return record.value + signature + self._public_der + struct.pack(">H", len(self._public_der)) + self.MAGIC

    @classmethod
    def _split(cls, value: bytes):
        """(value, public key DER, signature) of a signed value, or None."""
        if len(value) < 6 or value[-4:] != cls.MAGIC:
            return None
        (key_len,) = struct.unpack(">H", value[-6:-4])
        body = value[:-6]
        if key_len == 0 or key_len > len(body):
            return None
        public_der, rest = body[-key_len:], body[:-key_len]
        try:
            key = serialization.load_der_public_key(public_der)
        except (ValueError, TypeError, UnsupportedAlgorithm):  # bytes from another peer: anything but a key
            return None
        if not isinstance(key, rsa.RSAPublicKey) or key.key_size > 8192 or len(rest) < key.key_size // 8:
            return None
        sig_len = key.key_size // 8
        return rest[:-sig_len], public_der, rest[-sig_len:], key

    def strip_value(self, record: DHTRecord) -> bytes:
        if _subkey_peer(record) is None:
            return record.value
        parts = self._split(record.value)
        return parts[0] if parts else record.value

    def validate(self, record: DHTRecord) -> bool:
        owner = _subkey_peer(record)
        if owner is None:
            return True  # not a record about a peer
        parts = self._split(record.value)
        if parts is None:
            if SwarmKeyValidator.split(record.value):
                self._warn("refused a DHT record tagged with a swarm key: this swarm is private; start this peer "
                           "with the swarm's --swarm-key FILE")
            else:
                self._warn(f"refused an unsigned DHT record about peer {PeerID(owner).to_base58()}")
            return False
        value, public_der, signature, key = parts
        if peer_id_of(public_der).to_bytes() != owner:
            self._warn(f"refused a DHT record about peer {PeerID(owner).to_base58()} signed by another peer")
            return False
        try:
            key.verify(signature, _record_bytes(dataclasses.replace(record, value=value)), _RSA_PADDING,
                       hashes.SHA256())
        except (InvalidSignature, ValueError):
            self._warn(f"refused a DHT record about peer {PeerID(owner).to_base58()} with a bad signature")
            return False
        return True

    @property
    def priority(self) -> int:
        return 10

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, PeerSignatureValidator) and other.peer_id == self.peer_id


# ---- messages on libp2p streams -----------------------------------------------------------------------------------

def limit_stream_messages(max_bytes: int = MAX_STREAM_MESSAGE_BYTES) -> None:
    """Make hivemind refuse a stream message longer than ``max_bytes`` instead of reading it into memory: its
    ``P2P.receive_raw_data`` trusts the 8-byte length a peer announces. Idempotent; call in every process that
    serves or calls peers (the averager and DHT processes inherit it from the host when forked)."""
    from hivemind.p2p import P2P

    if getattr(P2P.receive_raw_data, "p2ptrain_limit", None) == max_bytes:
        return

    async def receive_raw_data(reader):
        header = await reader.readexactly(P2P.HEADER_LEN)
        content_length = int.from_bytes(header, P2P.BYTEORDER)
        if content_length > max_bytes:
            raise ValueError(f"a peer announced a {content_length}-byte message; the limit is {max_bytes} bytes")
        return await reader.readexactly(content_length)

    receive_raw_data.p2ptrain_limit = max_bytes
    P2P.receive_raw_data = staticmethod(receive_raw_data)
