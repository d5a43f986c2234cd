"""One-off GPU check (not committed): the GPU plan's evaluation peak at eval batch 32, eager vs MONAI's SDPA path."""
import json, sys, time
from pathlib import Path
import torch
from gx_ray.data.demo.cohort import DemoConfig
from gx_ray.data.prepare import PrepareConfig, prepare_data
from gx_ray.data.preprocess import PreprocessConfig
from gx_ray.sweep.cluster_benchmark import ClusterBenchmarkConfig, _space
from gx_ray.sweep.spaces import load_space
from gx_ray.train.config import TrialConfig
from gx_ray.train.loop import autocast, build_trial, first_rows, on_device, probe_trial

out = Path("/tmp/gc")
t = time.time()
prepared = prepare_data("demo", out / "prepared", PrepareConfig(preprocess=PreprocessConfig.preset("bench"), endoscopy_size=64), DemoConfig(cases=12, seed=0))
shards = str(prepared.shard_dir)
print("cohort", round(time.time() - t), "s", flush=True)
loaded = load_space(str(_space(out / "s.yaml", ClusterBenchmarkConfig(), ("image_only",), None)))
results = {}
for task in sys.argv[1].split(","):
    for flash in (False, True):
        flat = {**loaded.resource_keys(), **loaded.resolve({"task": task, "schema": "image_only", "seed": 0}), "data.shards": shards}
        if flash:
            flat["model.vision_kwargs"] = {"use_flash_attention": True}
        t = time.time()
        p = probe_trial(flat)
        probe_s = time.time() - t
        config = TrialConfig.from_flat(flat)
        dev = torch.device("cuda")
        _, model, layout = build_trial(config, dev)
        model.eval()
        batch = on_device(first_rows(shards, "val", 32, layout), dev)
        with torch.no_grad(), autocast(config, dev):
            model(batch); torch.cuda.synchronize(); t = time.time()
            for _ in range(3):
                model(batch)
            torch.cuda.synchronize()
        key = f"{task}/{'sdpa' if flash else 'default'}"
        results[key] = {"train_gib": p["train_peak_bytes"] / 2**30, "eval_gib": p["eval_peak_bytes"] / 2**30, "eval_rows_per_s": 96 / (time.time() - t), "probe_s": probe_s}
        print(key, json.dumps({k: round(v, 2) for k, v in results[key].items()}), flush=True)
        del model; torch.cuda.empty_cache()
