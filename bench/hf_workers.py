"""N workers on one GPU, each loading the same transformers model: transformers' own ``from_pretrained`` against
``cuctxd.client.hf_models.from_pretrained``, in one run (``python -m bench.hf_workers``; needs a GPU, torch and
transformers).

A random-weight Llama (hidden 2048, MLP 8192, 16 layers, vocab 32000, untied: 1.1B parameters, bfloat16) is written with
``save_pretrained`` (shards plus an index) into a temporary folder. Then, for each way in turn, ``--workers``
spawned processes start together; each loads the model onto GPU 0 and runs one forward pass over the same prompt.
Printed: each way's time to the first token (from the processes' common start to each worker's first logits;
the slowest and the median), the GPU memory the workers added (free memory before the round, minus free memory
once every worker holds its model; the daemon's own context predates both rounds; a cuctxd round counts the
layout the first worker published), and whether every worker's logits are identical to the first transformers
worker's. The files are read by the transformers round first, so both rounds read them from the page cache.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.daemon_run import start_daemon

PROMPT = [1, 450, 4996, 17354, 1701, 432, 17204, 975, 278, 17366, 11203, 29889]


def write_model(folder: str, hidden: int, layers: int, vocab: int) -> int:
    """A random Llama written with save_pretrained on GPU 0 (a spawned process: the GPU memory goes with it)."""
    import torch
    import transformers

    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 4, num_hidden_layers=layers,
                                      num_attention_heads=hidden // 128, num_key_value_heads=hidden // 512 or 1,
                                      vocab_size=vocab, max_position_embeddings=2048, tie_word_embeddings=False,
                                      torch_dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cuda:0"):
        model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="1GB")
    return sum(param.numel() for param in model.parameters())


def worker(way: str, folder: str, endpoint: str, start: float, results: Any, measured: Any) -> None:
    """One worker: load, one forward pass, report, hold the model until the parent has measured the memory."""
    import os

    os.environ["CUCTXD_ENDPOINT"] = endpoint
    import torch
    import transformers

    torch.cuda.set_device(0)
    if way == "transformers":
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.bfloat16,
                                                                      device_map="cuda:0")
        except (ImportError, ValueError):  # a transformers that wants accelerate for device_map
            model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.bfloat16).to("cuda:0")
    else:
        from cuctxd.client import hf_models

        model = hf_models.from_pretrained(folder, torch_dtype=torch.bfloat16, device=0)
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT], device="cuda:0")).logits
    torch.cuda.synchronize()
    took = time.time() - start
    results.put((took, logits.float().cpu()))
    measured.wait(300)


def run_round(way: str, folder: str, endpoint: str, workers: int) -> dict[str, Any]:
    import torch

    context = multiprocessing.get_context("spawn")
    results, measured = context.Queue(), context.Event()
    free_before = torch.cuda.mem_get_info(0)[0]
    start = time.time()
    processes = [context.Process(target=worker, args=(way, folder, endpoint, start, results, measured))
                 for _ in range(workers)]
    for process in processes:
        process.start()
    got = [results.get(timeout=300) for _ in processes]
    free_after = torch.cuda.mem_get_info(0)[0]
    measured.set()
    for process in processes:
        process.join(60)
    times = sorted(took for took, _ in got)
    return {"way": way, "first_token_s_max": round(times[-1], 2), "first_token_s_median": round(
        statistics.median(times), 2), "added_gib": round((free_before - free_after) / 2**30, 2),
        "logits": [logits for _, logits in got]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hf_workers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args(argv)
    import torch

    with tempfile.TemporaryDirectory(prefix="cuctxd-hf-") as temp:
        folder = str(Path(temp) / "llama")
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            parameters = pool.apply(write_model, (folder, args.hidden, args.layers, args.vocab))
        daemon = start_daemon(Path(temp), "cuda", 1, "64MiB")
        try:
            torch.cuda.init()
            rounds = [run_round(way, folder, daemon.ipc, args.workers) for way in ("transformers", "cuctxd")]
        finally:
            daemon.stop()
    reference = rounds[0]["logits"][0]
    identical = all(torch.equal(logits, reference) for each in rounds for logits in each["logits"])
    summary = {"parameters": parameters, "workers": args.workers, "device": torch.cuda.get_device_name(0),
               "logits_identical": identical,
               "rounds": [{key: value for key, value in each.items() if key != "logits"} for each in rounds]}
    for each in summary["rounds"]:
        print(f"{each['way']:>12}: first token {each['first_token_s_median']:6.2f} s median, "
              f"{each['first_token_s_max']:6.2f} s slowest; GPU memory added {each['added_gib']:6.2f} GiB")
    print(f"{parameters / 1e9:.2f}B parameters, {args.workers} workers, {summary['device']}: logits identical: "
          f"{identical}")
    print(json.dumps(summary))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
