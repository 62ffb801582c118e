"""A small checkpoint saved to an s3:// logdir (moto's S3 server on loopback, the stand-in the tests
use) against the same checkpoint saved to a local directory, side by side in one run.

What it measures: ``checkpoint.write_shard`` + ``checkpoint.commit`` of one 1 MB tensor (``keep=3``,
so every save from the fourth on also prunes one), repeated, interleaved local/S3, medians and
spreads. The S3 client is made once per process (``psflow.checkpoint.remote``); the figure shows what
each save costs after that: the shard's PUT, the manifest's PUT, the listing and the prune.

Run: ``.venv/bin/python benchmarks/bench_s3_checkpoint.py [--quick] [--reps N]``. Needs the dev extra (moto, s3fs).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time

import harness
import torch
from harness import log, md_table, median, spread


def main() -> None:
    p = harness.arg_parser(__doc__.splitlines()[0])
    args = p.parse_args()
    reps = harness.reps_of(args, full=20, quick=5)
    import boto3
    from moto.server import ThreadedMotoServer

    from psflow import checkpoint

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://{host}:{port}")
    boto3.client("s3").create_bucket(Bucket="bench")
    tensors = {"w": torch.zeros(256 * 1024)}  # 1 MB
    took: dict[str, list[float]] = {"local": [], "s3": []}
    with tempfile.TemporaryDirectory() as tmp:
        roots = {"local": os.path.join(tmp, "checkpoints"), "s3": "s3://bench/run/checkpoints"}
        for step in range(1, reps + 2):
            for name, root in roots.items():
                t0 = time.perf_counter()
                checkpoint.commit(root, step, [checkpoint.write_shard(root, step, 0, 1, tensors)], meta={}, keep=3)
                if step > 1:  # the first save of each target makes its client and directories
                    took[name].append(time.perf_counter() - t0)
    server.stop()
    log(f"{reps} saves each")
    rows = [[name, f"{median(v) * 1000:.1f} ms", spread([x * 1000 for x in v], ".0f") + " ms"] for name, v in took.items()]
    print(f"{harness.machine()}\n\n`{harness.command_line()}`\n")
    print(md_table(["1 MB checkpoint to", "median save", "spread"], rows))
    print(f"\nS3 / local: {median(took['s3']) / median(took['local']):.1f}x")


if __name__ == "__main__":
    main()
