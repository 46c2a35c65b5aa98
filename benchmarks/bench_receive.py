"""What receiving a part costs the receiver's CPU: asyncio's StreamReader against p2ptrain's FrameReader.

    python benchmarks/bench_receive.py --megabytes 400 --repeats 3

Two processes on 127.0.0.1, each with hivemind's P2P (its p2pd) and uvloop, as the averager runs. One opens a stream
to the other and writes 2 MiB part frames (``part_stream.frame``'s bytes) as fast as the stream takes them; the other
reads them, alternately with ``StreamReader.readexactly`` (what the part stream did before) and with
``FrameReader`` (``averaging/frame_reader.py``). Prints, per way of reading, the receiver's CPU seconds (its process
time while it read) and MB/s. The rate is bound by p2pd and the machine's cores; the CPU seconds are the figure.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import time

MiB = 1 << 20
PART_BYTES = 2 * MiB


def _peer(index: int, way: str, frames: int, maddrs, barrier, results) -> None:
    import uvloop
    from hivemind.p2p import P2P, PeerID

    from p2ptrain.averaging.part_stream import FRAME, MESSAGE, frame, frame_reader

    async def main() -> None:
        while index == 1 and 0 not in maddrs:
            await asyncio.sleep(0.05)
        p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=list(maddrs.get(0, [])))
        maddrs[index] = [str(m) for m in await p2p.get_visible_maddrs()]
        done = asyncio.Event()

        async def receive(_info, reader, writer) -> None:
            started, cpu = time.perf_counter(), time.process_time()
            received = 0
            if way == "StreamReader":
                for _ in range(frames):
                    _, meta_length, payload_length = FRAME.unpack(await reader.readexactly(FRAME.size))
                    received += len(await reader.readexactly(meta_length)) + len(await reader.readexactly(
                        payload_length))
            else:
                stream = frame_reader(reader, writer)
                for _ in range(frames):
                    _, meta, payload = await stream.read_frame()
                    received += len(meta) + len(payload)
            results[way] = (time.process_time() - cpu, received / (time.perf_counter() - started) / 1e6)
            writer.close()
            done.set()

        await p2p.add_binary_stream_handler("bench_receive", receive)
        await asyncio.get_running_loop().run_in_executor(None, barrier.wait)
        if index == 1:
            other = PeerID.from_base58(maddrs[0][0].rsplit("/p2p/", 1)[1])
            _, _, writer = await p2p.call_binary_stream_handler(other, "bench_receive")
            head, payload = frame(MESSAGE, b"m" * 200, os.urandom(PART_BYTES))
            payload = memoryview(payload)
            for _ in range(frames):
                writer.write(head)
                writer.write(payload)
                await writer.drain()
        else:
            await done.wait()
        await asyncio.get_running_loop().run_in_executor(None, barrier.wait)
        await p2p.shutdown()

    uvloop.run(main())


def measure(way: str, megabytes: int) -> tuple:
    """(receiver CPU s, MB/s) of one transfer of ``megabytes`` in 2 MiB frames, read ``way``."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        maddrs, results = manager.dict(), manager.dict()
        barrier = ctx.Barrier(2)
        frames = max(1, megabytes * MiB // PART_BYTES)
        procs = [ctx.Process(target=_peer, args=(i, way, frames, maddrs, barrier, results)) for i in range(2)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(300)
        if way not in results:
            raise RuntimeError(f"the {way} transfer failed (a peer process died)")
        return results[way]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=int, default=400, help="MiB sent per transfer")
    parser.add_argument("--repeats", type=int, default=3, help="transfers per way of reading, alternating")
    args = parser.parse_args(argv)
    figures = {"StreamReader": [], "FrameReader": []}
    for repeat in range(args.repeats):
        for way in figures:
            cpu_s, rate = measure(way, args.megabytes)
            figures[way].append((cpu_s, rate))
            print(f"{way:12s} run {repeat + 1}: receiver CPU {cpu_s:.3f} s for {args.megabytes} MiB, {rate:.0f} MB/s",
                  flush=True)
    for way, runs in figures.items():
        cpu = [c for c, _ in runs]
        print(f"{way:12s}: receiver CPU {min(cpu):.3f}-{max(cpu):.3f} s (median {statistics.median(cpu):.3f}), "
              f"{statistics.median(r for _, r in runs):.0f} MB/s median")


if __name__ == "__main__":
    main()
