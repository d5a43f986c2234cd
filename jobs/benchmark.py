"""Benchmarks, measured as ratios within one run on one machine.

python jobs/benchmark.py ingest [--cpus 4] [--consumers 1]     # preprocessing and the Ray Data stream
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gx_ray.data.ingest_benchmark import IngestBenchmarkConfig, format_ingest_result, run_ingest_benchmark


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    ingest = commands.add_parser("ingest", help="preprocessing cases/min per core; stream vs raw pyarrow rate")
    ingest.add_argument("--out", type=Path, default=Path("outputs/benchmark/ingest"))
    ingest.add_argument("--cases", type=int, default=IngestBenchmarkConfig.cases)
    ingest.add_argument("--preset", default=IngestBenchmarkConfig.preset)
    ingest.add_argument("--stream-rows", type=int, default=IngestBenchmarkConfig.stream_rows)
    ingest.add_argument("--batch-size", type=int, default=IngestBenchmarkConfig.batch_size)
    ingest.add_argument("--consumers", type=int, default=IngestBenchmarkConfig.consumers)
    ingest.add_argument("--epochs", type=int, default=IngestBenchmarkConfig.epochs)
    ingest.add_argument("--cpus", type=int, help="CPUs for the local Ray cluster (default: all)")
    ingest.add_argument("--codec", default="lz4", choices=["zstd", "lz4", "none"], help="Parquet codec of the stream")
    args = parser.parse_args(argv)

    if args.command == "ingest":
        config = IngestBenchmarkConfig(
            cases=args.cases,
            preset=args.preset,
            stream_rows=args.stream_rows,
            batch_size=args.batch_size,
            consumers=args.consumers,
            epochs=args.epochs,
            cpus=args.cpus,
            codec=args.codec,
        )
        print(format_ingest_result(run_ingest_benchmark(args.out, config)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
