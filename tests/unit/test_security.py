"""The swarm key file, admission tokens, and the DHT record validators (security.py), without a network."""

from __future__ import annotations

import dataclasses
import os

import pytest
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.p2p import P2P, PeerID
from hivemind.utils import MSGPackSerializer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2ptrain.security import (KeyFileError, PeerSignatureValidator, SwarmAuth, SwarmKeyValidator,
                               generate_swarm_key, load_identity, load_swarm_key)


@pytest.fixture(scope="module")
def identities(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ids")
    paths = [str(folder / f"id{i}.key") for i in range(2)]
    for path in paths:
        P2P.generate_identity(path)
    return [load_identity(path) for path in paths]


def record(subkey: object, value: object = b"payload", expiration: float = 1e9) -> DHTRecord:
    return DHTRecord(b"k" * 20, MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value), expiration)


def test_keygen_writes_a_private_key_and_never_overwrites(tmp_path):
    path = tmp_path / "swarm.key"
    generate_swarm_key(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    key = load_swarm_key(path)
    assert len(key) == 32
    with pytest.raises(KeyFileError, match="never overwrites"):
        generate_swarm_key(path)
    assert load_swarm_key(path) == key


@pytest.mark.parametrize("content, mode, match", [
    (None, 0o600, "does not exist"),
    ("ab" * 32 + "\n", 0o644, "chmod 600"),
    ("ab" * 32 + "\n", 0o640, "chmod 600"),
    ("not a key\n", 0o600, "64 hex digits"),
    ("ab" * 31 + "\n", 0o600, "64 hex digits"),
    ("", 0o600, "64 hex digits"),
])
def test_bad_key_files_are_refused_with_the_fix(tmp_path, content, mode, match):
    path = tmp_path / "swarm.key"
    if content is not None:
        path.write_text(content)
        path.chmod(mode)
    with pytest.raises(KeyFileError, match=match) as error:
        load_swarm_key(path)
    assert "\n" not in str(error.value) and str(path) in str(error.value)


def test_tokens_are_bound_to_the_key_and_the_peer(identities):
    auth, other = SwarmAuth.from_key(b"k" * 32), SwarmAuth.from_key(b"j" * 32)
    a, b = (PeerSignatureValidator(key).peer_id for key in identities)
    assert auth.admits(a, auth.token(a))
    assert not auth.admits(b, auth.token(a))  # a token replayed by another peer
    assert not auth.admits(a, other.token(a))  # another swarm's key
    assert not auth.admits(a, b"") and not auth.admits(a, None) and not auth.admits(a, "text")
    open_swarm = SwarmAuth.from_key(None)
    assert not open_swarm.private and open_swarm.token(a) == b"" and open_swarm.admits(a, None)


def test_swarm_key_validator_tags_and_refuses_untagged_or_altered_records():
    validator = SwarmKeyValidator(SwarmAuth.from_key(b"k" * 32))
    plain = record(b"subkey")
    tagged = dataclasses.replace(plain, value=validator.sign_value(plain))
    assert validator.validate(tagged)
    assert validator.strip_value(tagged) == plain.value
    assert not validator.validate(plain)  # written by a peer without the key
    assert not validator.validate(dataclasses.replace(tagged, expiration_time=2e9))  # replayed with a longer life
    assert not validator.validate(dataclasses.replace(tagged, value=b"x" + tagged.value[1:]))
    other = SwarmKeyValidator(SwarmAuth.from_key(b"j" * 32))
    assert not other.validate(tagged)  # another swarm's key


def test_records_about_a_peer_must_be_signed_by_that_peer(identities):
    mine, theirs = (PeerSignatureValidator(key) for key in identities)
    own = record(mine.peer_id.to_bytes())
    signed = dataclasses.replace(own, value=mine.sign_value(own))
    assert theirs.validate(signed) and mine.validate(signed)
    assert theirs.strip_value(signed) == own.value
    # a peer cannot write (or rewrite) a record under another peer's id: it can only sign with its own key
    forged = record(theirs.peer_id.to_bytes())
    assert mine.sign_value(forged) == forged.value  # not signed: not our subkey
    assert not theirs.validate(forged)
    moved = dataclasses.replace(forged, value=mine.sign_value(own))  # our signed value under their subkey
    assert not theirs.validate(moved)
    assert not theirs.validate(dataclasses.replace(signed, expiration_time=2e9))  # replayed with a longer life
    # records that are not about a peer (e.g. shard cursors, keyed by shard index) need no signature
    assert theirs.validate(record(7))


def test_signature_and_swarm_key_compose_as_in_the_dht(identities):
    """hivemind's CompositeValidator signs in increasing priority and checks in decreasing: the swarm key's tag
    is outermost, and both are stripped before the value is read."""
    key = b"k" * 32
    writer = CompositeValidator([PeerSignatureValidator(identities[0]), SwarmKeyValidator(SwarmAuth.from_key(key))])
    reader = CompositeValidator([PeerSignatureValidator(identities[1]), SwarmKeyValidator(SwarmAuth.from_key(key))])
    own = record(PeerSignatureValidator(identities[0]).peer_id.to_bytes(), value={"outer_step": 3})
    stored = dataclasses.replace(own, value=writer.sign_value(own))
    assert reader.validate(stored)
    assert MSGPackSerializer.loads(reader.strip_value(stored)) == {"outer_step": 3}
    keyless = CompositeValidator([PeerSignatureValidator(identities[1])])
    assert not keyless.validate(stored)  # a peer without the key cannot read the private swarm's records
    assert not reader.validate(dataclasses.replace(own, value=keyless.sign_value(own)))


def test_peer_ids_match_what_p2pd_derives(tmp_path):
    path = str(tmp_path / "id.key")
    P2P.generate_identity(path)
    with open(path, "rb") as f:
        assert PeerSignatureValidator(load_identity(path)).peer_id == PeerID.from_identity(f.read())


# ---- fuzzed: records come from other peers --------------------------------------------------------------------------

FUZZ = settings(database=None, deadline=None, max_examples=150,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(subkey=st.one_of(st.binary(max_size=40), st.integers(-2**63, 2**63 - 1), st.none()),
       value=st.binary(max_size=700), expiration=st.floats(allow_nan=True, allow_infinity=True))
def test_validators_refuse_random_records_without_raising(identities, subkey, value, expiration):
    signer = PeerSignatureValidator(identities[0])
    swarm = SwarmKeyValidator(SwarmAuth.from_key(b"k" * 32))
    for subkey_bytes in (MSGPackSerializer.dumps(subkey), value[:40], b""):
        candidate = DHTRecord(b"k" * 20, subkey_bytes, value, expiration)
        assert swarm.validate(candidate) is False  # a random value never carries a valid tag
        assert isinstance(signer.validate(candidate), bool)
        assert isinstance(signer.strip_value(candidate), bytes) and isinstance(swarm.strip_value(candidate), bytes)


@FUZZ
@given(flip=st.integers(min_value=0), tail=st.binary(max_size=8))
def test_a_signed_record_altered_anywhere_is_refused(identities, flip, tail):
    signer = PeerSignatureValidator(identities[0])
    own = record(signer.peer_id.to_bytes(), value={"outer_step": 5})
    signed = bytearray(signer.sign_value(own))
    index = flip % len(signed)
    signed[index] ^= 0xFF
    altered = dataclasses.replace(own, value=bytes(signed))
    assert not signer.validate(altered)
    if tail:
        assert not signer.validate(dataclasses.replace(own, value=signer.sign_value(own) + tail))
