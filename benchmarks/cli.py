"""Benchmarks, measured as ratios within one run on one machine; each run also writes its figures to
benchmarks/results/ (--results DIR elsewhere), named by their conditions (docs/benchmarks.md).

python jobs/benchmark.py ingest [--cpus 4] [--consumers 1]     # preprocessing and the Ray Data stream
python jobs/benchmark.py model --model swin3d --shape 4,64,128,128 --batch 8 [--steps 10] [--amp bf16|off]
                                                               # training samples/s: registry model vs raw MONAI
python jobs/benchmark.py vlm [--size 2b|tiny|llava_1_5|...] [--batch 8] [--packing] [--varied]  # LoRA: gx-ray vs raw
    [--trials stage_classification,vqa]                        # then whole trials through the sweep
python jobs/benchmark.py sweep [--space modality_ablation]    # a sweep's wall time: data, start-up, training
    [--cpu-hours 1 | --gpu-hours 1]                            # and a budget's forecast against the ledger
python jobs/benchmark.py startup [--launches 3]                # launch → first optimiser step of one trial,
                                                               # part by part, cold then warm
python jobs/benchmark.py loop [--tasks lesion_detection] [--neighbours 3]  # a trial's loop vs its raw step
python jobs/benchmark.py attention                            # one GPU: what attention's first sight of each
                                                               # text shape costs, cuDNN attention on vs off
python jobs/benchmark.py cluster [--gpus N] [--budget 540]    # the ablation on every GPU of a node: busy fraction,
                                                               # start-up, DDP scaling, loop/raw, 8-GPU projection
python jobs/benchmark.py search [--space lr_sweep] [--preset smoke]  # grid, random, ASHA + TPE, BOHB, PBT, with
    [--folds 5] [--truth-cases 1000]                           # and without CV, against a held-out truth set
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.ingest import IngestBenchmarkConfig, format_ingest_result, run_ingest_benchmark
from benchmarks.model import AMP_MODES, ModelBenchmarkConfig, format_model_result, run_model_benchmark
from benchmarks.results import write_results
from benchmarks.vlm_memory import REAL
from gx_ray.models.fusion import FUSIONS
from gx_ray.models.vision import SWIN_ATTENTION, VISION_ENCODERS
from gx_ray.runtime import tolerant_console


def shape(text: str) -> tuple[int, int, int, int]:
    sizes = tuple(int(s) for s in text.split(","))
    if len(sizes) != 4:
        raise argparse.ArgumentTypeError(f"--shape takes C,D,H,W; got {text!r}")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--results", type=Path, help="where the figures' data file goes (default benchmarks/results/)")
    ingest = commands.add_parser(
        "ingest", parents=[common], help="preprocessing cases/min per core; stream vs raw pyarrow rate"
    )
    ingest.add_argument("--out", type=Path, default=Path("outputs/benchmark/ingest"))
    ingest.add_argument("--cases", type=int, default=IngestBenchmarkConfig.cases)
    ingest.add_argument("--preset", default=IngestBenchmarkConfig.preset)
    ingest.add_argument("--stream-rows", type=int, default=IngestBenchmarkConfig.stream_rows)
    ingest.add_argument("--batch-size", type=int, default=IngestBenchmarkConfig.batch_size)
    ingest.add_argument("--consumers", type=int, default=IngestBenchmarkConfig.consumers)
    ingest.add_argument("--epochs", type=int, default=IngestBenchmarkConfig.epochs)
    ingest.add_argument("--cpus", type=int, help="CPUs for the local Ray cluster (default: all)")
    ingest.add_argument("--codec", default="lz4", choices=["zstd", "lz4", "none"], help="Parquet codec of the stream")
    model = commands.add_parser(
        "model", parents=[common], help="training samples/s and peak memory: registry model vs raw MONAI"
    )
    model.add_argument("--model", required=True, choices=list(VISION_ENCODERS))
    model.add_argument("--shape", required=True, type=shape, help="one sample's C,D,H,W, e.g. 4,64,128,128")
    model.add_argument("--batch", required=True, type=int)
    model.add_argument("--steps", type=int, default=ModelBenchmarkConfig.steps, help="timed steps")
    model.add_argument("--warmup", type=int, default=ModelBenchmarkConfig.warmup, help="untimed steps first")
    model.add_argument("--amp", default=ModelBenchmarkConfig.amp, choices=AMP_MODES)
    model.add_argument("--fusion", default=ModelBenchmarkConfig.fusion, choices=list(FUSIONS))
    model.add_argument("--gradient-checkpointing", action="store_true", help="swin3d only")
    model.add_argument("--compile", action="store_true", help="torch.compile the CT network (model.compile)")
    model.add_argument(
        "--attention", choices=SWIN_ATTENTION, help="swin3d's window attention (default fused; raw MONAI: explicit)"
    )
    model.add_argument("--device", help="default: cuda when available, else cpu")
    sweep = commands.add_parser(
        "sweep", parents=[common], help="wall time of a sweep: data, start-up and training per trial"
    )
    sweep.add_argument("--space", default="modality_ablation")
    sweep.add_argument("--preset", action="append", default=[])
    sweep.add_argument("--output", type=Path, default=Path("outputs/benchmark/sweep"))
    sweep.add_argument("--data", type=Path, help="prepared data; default: the demo cohort, prepared afresh")
    sweep.add_argument("--cpu-hours", type=float, help="a budget: its forecast set beside what the trials spent")
    sweep.add_argument("--gpu-hours", type=float, help="the same in GPU-hours, for trials on GPUs")
    startup = commands.add_parser(
        "startup", parents=[common], help="launch → first optimiser step of one trial, part by part, cold and warm"
    )
    startup.add_argument("--launches", type=int, default=3, help="the first cold, the rest warm (default 3)")
    startup.add_argument("--demo-cases", type=int, default=200, help="size of the demo cohort (default 200)")
    startup.add_argument("--gpu", action="store_true", help="the trial on one GPU (4 CPUs), as a GPU sweep's")
    startup.add_argument("--output", type=Path, default=Path("outputs/benchmark/startup"))
    cluster = commands.add_parser(
        "cluster", parents=[common], help="GPU busy fraction, start-up, DDP scaling, loop/raw, projection"
    )
    cluster.add_argument("--gpus", type=int, help="GPUs to use (default: all)")
    cluster.add_argument("--budget", type=float, default=540.0, help="seconds for the whole run (default 540)")
    cluster.add_argument("--output", type=Path, default=Path("outputs/benchmark/cluster"))
    cluster.add_argument("--steps-per-epoch", type=int, default=30)
    cluster.add_argument("--gpus-per-trial", default="auto", help="auto (measured packing), 1, 0.5, ...")
    cluster.add_argument("--compile", action="store_true", help="measure compiled models (model.compile)")
    cluster.add_argument("--tasks", help="comma-separated tasks of the slice (default: all five)")
    cluster.add_argument("--address", help="an existing Ray cluster, e.g. jobs/cluster/two_nodes_one_host.sh's")
    cluster.add_argument(
        "--ddp-sizes", default="1,2,4", help="GPUs per DDP trial for weak scaling (default 1,2,4; 1 skips DDP)"
    )
    search = commands.add_parser(
        "search",
        parents=[common],
        help="searches against a held-out truth set: true score of each one's choice, "
        "its corrected estimate, device-hours to within 1 %% of the best true score",
    )
    search.add_argument("--space", default="lr_sweep", help="a space with a sample section and pbt, bohb presets")
    search.add_argument("--preset", action="append", default=[], help="applied to every sweep (smoke, gpu)")
    search.add_argument("--lrs", type=int, default=5, help="the grid's learning rates, log-spaced (default 5)")
    search.add_argument("--methods", default="grid,random,asha_tpe,bohb,pbt", help="default: all five")
    search.add_argument("--folds", type=int, default=5, help="the cross-validated objective's folds (0: none)")
    search.add_argument("--epochs", type=int, help="every trial's epochs (default: the space's and presets')")
    search.add_argument("--samples", type=int, help="every search's trials but the grid's (default: the space's)")
    search.add_argument("--truth-cases", type=int, default=1000, help="truth-set patients (default 1000)")
    search.add_argument("--demo-cases", type=int, default=200, help="the searched demo cohort's cases (default 200)")
    search.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples (default 1000)")
    search.add_argument("--output", type=Path, default=Path("outputs/benchmark/search"))
    attention = commands.add_parser(
        "attention", parents=[common], help="one-off cost of new text shapes per SDPA backend choice"
    )
    attention.add_argument("--max-new-tokens", type=int, default=256, help="tokens the report decoder writes")
    attention.add_argument("--output", type=Path, default=Path("outputs/benchmark/attention.json"))
    loop = commands.add_parser(
        "loop", parents=[common], help="training loop vs raw step per trial, and which part of the loop costs"
    )
    loop.add_argument("--tasks", default="lesion_detection,stage_classification", help="comma-separated tasks")
    loop.add_argument("--schemas", default="image_only", help="comma-separated schemas")
    loop.add_argument("--variants", help="comma-separated: stream, in_memory, no_shuffle, switch_0.5ms (default all)")
    loop.add_argument("--steps-per-epoch", type=int, default=10)
    loop.add_argument("--profile", action="store_true", help="also profile each cell's stream (cProfile)")
    loop.add_argument("--gpus", type=int, help="GPUs to use (default: all)")
    loop.add_argument(
        "--neighbours", type=int, default=0, help="then again beside N trial loops on each other GPU (a full node)"
    )
    loop.add_argument("--output", type=Path, default=Path("outputs/benchmark/loop"))
    vlm = commands.add_parser(
        "vlm", parents=[common], help="VLM LoRA training samples/s and peak memory: gx-ray's step vs raw"
    )
    vlm.add_argument("--size", default="2b", choices=["2b", "tiny", *REAL], help="2b, tiny, or a paper model")
    vlm.add_argument("--batch", type=int, default=8)
    vlm.add_argument("--steps", type=int, default=10, help="timed steps")
    vlm.add_argument("--rank", type=int, default=16, help="LoRA rank")
    vlm.add_argument("--gradient-checkpointing", action="store_true")
    vlm.add_argument("--packing", action="store_true", help="vlm.packing: the batch as one row, no padding")
    vlm.add_argument("--varied", action="store_true", help="questions of different lengths (padding to pack away)")
    vlm.add_argument("--device", help="default: cuda when available, else cpu")
    vlm.add_argument("--trials", help="then whole trials through the sweep, a task each (stage_classification,vqa)")
    vlm.add_argument("--cases", type=int, default=160, help="demo cases for --trials")
    vlm.add_argument("--output", type=Path, default=Path("outputs/benchmarks/vlm"))
    return parser


def main(argv: list[str] | None = None) -> int:
    tolerant_console()
    parser = build_parser()
    args = parser.parse_args(argv)

    def record(command: str, conditions: dict, figures: object) -> None:
        print(f"figures written to {write_results(command, conditions, figures, args.results)}", file=sys.stderr)

    if args.command == "vlm":
        from benchmarks.vlm import VlmBenchmarkConfig, format_vlm_result, run_vlm_benchmark

        config = VlmBenchmarkConfig(
            size=args.size,
            batch=args.batch,
            steps=args.steps,
            rank=args.rank,
            gradient_checkpointing=args.gradient_checkpointing,
            packing=args.packing,
            varied=args.varied,
            device=args.device,
        )
        step = run_vlm_benchmark(config)
        print(format_vlm_result(step))
        conditions = {"size": args.size, "batch": f"b{args.batch}", "packing": "packed" if args.packing else None}
        record("vlm", conditions, step)
        if args.trials:
            from benchmarks.vlm_trials import format_vlm_trials, run_vlm_trials

            tasks = tuple(args.trials.split(","))
            rows = run_vlm_trials(args.size, tasks, args.output, args.gradient_checkpointing, demo_cases=args.cases)
            print(format_vlm_trials(rows, step))
            record("vlm-trials", {"size": args.size, "tasks": "+".join(tasks)}, rows)

    if args.command == "attention":
        from benchmarks.attention import (
            AttentionBenchmarkConfig,
            format_attention_result,
            run_attention_benchmark,
        )

        config = AttentionBenchmarkConfig(max_new_tokens=args.max_new_tokens)
        results = run_attention_benchmark(config)
        print(format_attention_result(results, config))
        record("attention", {}, results)
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")

    if args.command == "loop":
        from benchmarks.loop import VARIANTS, LoopBenchmarkConfig, format_loop_result, run_loop_benchmark

        variants = tuple(args.variants.split(",")) if args.variants else tuple(VARIANTS)
        if unknown := set(variants) - set(VARIANTS):
            parser.error(f"--variants: unknown {', '.join(sorted(unknown))} (known: {', '.join(VARIANTS)})")
        config = LoopBenchmarkConfig(
            tasks=tuple(args.tasks.split(",")),
            schemas=tuple(args.schemas.split(",")),
            variants=variants,
            steps_per_epoch=args.steps_per_epoch,
            profile=args.profile,
            gpus=args.gpus,
            neighbours=args.neighbours,
        )
        result = run_loop_benchmark(args.output, config)
        print(format_loop_result(result))
        record("loop", {"tasks": "+".join(config.tasks), "neighbours": f"n{args.neighbours}"}, result)

    if args.command == "cluster":
        from benchmarks.cluster import ClusterBenchmarkConfig, format_cluster_result, run_cluster_benchmark

        share = args.gpus_per_trial if args.gpus_per_trial == "auto" else float(args.gpus_per_trial)
        config = ClusterBenchmarkConfig(
            gpus=args.gpus,
            budget_s=args.budget,
            steps_per_epoch=args.steps_per_epoch,
            gpus_per_trial=share,
            address=args.address,
            compile=args.compile,
            ddp_sizes=tuple(int(n) for n in args.ddp_sizes.split(",")),
            **({"tasks": tuple(args.tasks.split(","))} if args.tasks else {}),
        )
        result = run_cluster_benchmark(args.output, config)
        print(format_cluster_result(result))
        record(
            "cluster", {"gpus": f"{args.gpus}gpu" if args.gpus else "allgpus", "budget": f"{args.budget:g}s"}, result
        )

    if args.command == "startup":
        from benchmarks.startup import StartupBenchmarkConfig, format_startup_result, run_startup_benchmark

        config = StartupBenchmarkConfig(launches=args.launches, demo_cases=args.demo_cases, gpu=args.gpu)
        result = run_startup_benchmark(args.output, config)
        print(format_startup_result(result))
        record("startup", {"cases": f"{args.demo_cases}cases", **({"trial": "gputrial"} if args.gpu else {})}, result)

    if args.command == "sweep":
        from benchmarks.sweep import format_sweep_result, run_sweep_benchmark
        from gx_ray.sweep.driver import SweepOptions

        options = SweepOptions(
            space=args.space,
            output=args.output,
            data=args.data,
            presets=tuple(args.preset),
            demo_dir=args.output / "demo",
            cpu_hours=args.cpu_hours,
            gpu_hours=args.gpu_hours,
        )
        result = run_sweep_benchmark(options)
        print(format_sweep_result(result))
        budget = "cpu-hours" if args.cpu_hours else "gpu-hours" if args.gpu_hours else None
        record("sweep", {"space": args.space, "presets": "+".join(args.preset) or None, "budget": budget}, result)

    if args.command == "search":
        from benchmarks.search import SearchBenchmarkConfig, figures, format_search_result, run_search_benchmark

        config = SearchBenchmarkConfig(
            space=args.space,
            lrs=args.lrs,
            presets=tuple(args.preset),
            methods=tuple(args.methods.split(",")),
            cost="gpu_seconds" if "gpu" in args.preset else "cpu_seconds",
            demo_cases=args.demo_cases,
            folds=args.folds,
            epochs=args.epochs,
            samples=args.samples,
            truth_cases=args.truth_cases,
            n_resamples=args.resamples,
        )
        result = run_search_benchmark(args.output, config)
        print(format_search_result(result))
        conditions = {"space": args.space, "presets": "+".join(args.preset) or None, "truth": f"t{args.truth_cases}"}
        record("search", conditions, figures(result))

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
        result = run_ingest_benchmark(args.out, config)
        print(format_ingest_result(result))
        record("ingest", {"preset": args.preset, "codec": args.codec, "consumers": f"c{args.consumers}"}, result)
    elif args.command == "model":
        config = ModelBenchmarkConfig(
            model=args.model,
            shape=args.shape,
            batch=args.batch,
            steps=args.steps,
            warmup=args.warmup,
            amp=args.amp,
            fusion=args.fusion,
            gradient_checkpointing=args.gradient_checkpointing,
            compile=args.compile,
            vision_kwargs={"attention": args.attention} if args.attention else {},
        )
        result = run_model_benchmark(config, args.device)
        print(format_model_result(result))
        conditions = {"model": args.model, "shape": args.shape, "batch": f"b{args.batch}", "amp": args.amp,
                      "compile": "compiled" if args.compile else "eager", "attention": args.attention}  # fmt: skip
        record("model", conditions, result.figures())
    return 0


if __name__ == "__main__":
    sys.exit(main())
