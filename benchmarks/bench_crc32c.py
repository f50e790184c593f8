"""crc32c throughput of the two implementations that check TF checkpoint entries.

    python benchmarks/bench_crc32c.py [--mib 256] [--repeats 3]

``google_crc32c`` (the C extension, when installed) and the numpy fallback of
``elmo_jax.compat.tf_checkpoint``, over the same random bytes held in memory (the figures leave disk
reads out), both fed in the 8 MiB pieces that ``TFCheckpoint.verify`` reads. Prints MB/s
(10^6 bytes per second), the best of ``--repeats`` runs, and what that means for bilm-tf's
released model (about 4 GB with its Adagrad slots).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from elmo_jax.compat import tf_checkpoint as tfc


def throughput(fn, data: bytes, piece: int, repeats: int) -> tuple[float, int]:
    best, crc = 0.0, 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        crc = 0
        for start in range(0, len(data), piece):
            crc = fn(data[start : start + piece], crc)
        best = max(best, len(data) / (time.perf_counter() - t0) / 1e6)
    return best, crc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="MiB of random bytes")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    data = np.random.default_rng(0).integers(0, 256, args.mib << 20, dtype=np.uint8).tobytes()
    piece = 8 << 20
    tfc._tables()  # built once per process (tens of ms): not part of the throughput
    impls = {"numpy": tfc.crc32c_numpy}
    try:
        import google_crc32c

        impls = {"google_crc32c": lambda b, crc: google_crc32c.extend(crc, b), **impls}
    except ImportError:
        print("google_crc32c is not installed: numpy only")
    crcs = {}
    for name, fn in impls.items():
        mbs, crcs[name] = throughput(fn, data, piece, args.repeats)
        print(f"{name:14s} {mbs:8.0f} MB/s   ({4e9 / mbs / 1e6:6.1f} s for 4 GB)")
    if len(set(crcs.values())) != 1:
        raise SystemExit(f"the implementations disagree: {crcs}")


if __name__ == "__main__":
    main()
