"""kvserve's perplexity beside llama.cpp's `llama-perplexity` on the same GGUF file and text, in one run.

Both sides chunk the text as llama-perplexity does: the text's tokens (with the BOS the tokenizer adds) cut into
chunks of `--ctx` tokens, each chunk's first token replaced by BOS where the vocabulary adds one, and the second
half of each chunk scored: the logits at positions ctx/2 .. ctx-2 against the tokens that follow them. The tokens
themselves are checked to be the same on both sides (`llama-tokenize`, where it is built): otherwise the two
perplexities would be of different texts.

Each side's drift from the file's own weights is also measured: the mean KL divergence, over the scored positions,
from the same weights dequantized and run in float32 (kvserve: `--dtype float32`; llama.cpp: the file requantized to
F32 by `llama-quantize`, then `llama-perplexity --kl-divergence`). On a few hundred tokens a perplexity moves by about
a percent with any small change of rounding; the KL divergence is the steadier measure of a server's own error.
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import tempfile
from pathlib import Path

import torch

from bench.common import machine, machine_line, markdown_table, write_results

TEXT = """The lighthouse on the northern point was built in the spring of a dry year, when the ships that carried \
grain along the coast had lost three of their number to the rocks in a single winter. The keeper who first lived \
there kept a journal, and most of what is known about those early days comes from it. He wrote about the weather \
every morning, about the oil that had to be carried up the stairs in the evening, and about the long hours of the \
night, when the only sound was the wind against the glass and the slow turning of the lens.

In the second year a storm tore the roof from the storehouse and scattered the winter's supplies across the \
headland. The keeper and his wife spent a week gathering what they could find, drying the flour in the sun and \
counting the candles that had survived. A fishing boat brought them a barrel of salted fish and a letter from the \
harbour master, who promised that a new storehouse would be built before the autumn. It was not built until the \
following summer, and the journal records, with some bitterness, that the promise had been made twice more in the \
meantime.

Visitors were rare. A surveyor came once to measure the height of the tower and the distance from which its light \
could be seen, and he stayed for three days because the sea was too rough for his boat to return. He taught the \
keeper's children to read a map and left them a small brass compass, which the family kept for two generations. \
Later keepers added their own notes to the journal, so that the book grew into a record of the whole station: the \
names of the ships that passed, the years of good and bad fishing, the birth of children and the deaths of old men.

When the light was finally replaced by an automatic lamp, the last keeper packed the journal into a wooden box and \
gave it to the museum in the town. It is still there, in a glass case near the window, open at a page from the \
first winter. The handwriting is small and careful, and the ink has faded to the colour of weak tea, but the words \
can still be read: the wind has turned to the west, the oil is low, and the light has burned through the night \
without fail.
"""


def chunks(ids: list[int], ctx: int, bos: int | None) -> list[list[int]]:
    """llama-perplexity's chunks: whole chunks of ctx tokens, each led by BOS where the vocabulary adds one."""
    out = []
    for start in range(0, len(ids) // ctx * ctx, ctx):
        chunk = ids[start:start + ctx]
        out.append(chunk if bos is None else [bos] + chunk[1:])
    return out


def kvserve_scores(gguf: Path, ids: list[int], ctx: int, bos: int | None) -> dict:
    """Perplexity as served and with the file's weights in float32, and the mean KL divergence between the two."""
    from engine import EngineConfig
    from weights.loading import load_engine
    from weights.resolve import resolve_model

    folder = resolve_model(str(gguf), progress=False)
    first = ctx // 2
    targets = torch.cat([torch.tensor(chunk[first + 1:ctx]) for chunk in chunks(ids, ctx, bos)])[:, None]

    def logprobs(dtype: str) -> torch.Tensor:  # (scored positions, V)
        engine = load_engine(folder, EngineConfig(max_batch_size=1, max_seq_len=ctx, dtype=dtype))
        try:
            return torch.cat([engine.prompt_logits(chunk)[first:ctx - 1].log_softmax(-1) for chunk in chunks(ids, ctx, bos)])
        finally:
            engine.close()

    served, exact = logprobs("auto"), logprobs("float32")
    perplexity = lambda lp: math.exp(-lp.gather(-1, targets).mean().item())
    return {"perplexity": perplexity(served), "float32 perplexity": perplexity(exact),
            "kl_divergence": (exact.exp() * (exact - served)).sum(-1).mean().item(),
            "same_top": (exact.argmax(-1) == served.argmax(-1)).float().mean().item()}


def llama_scores(bin_dir: Path, gguf: Path, text: Path, ctx: int, threads: int) -> dict:
    """llama-perplexity's perplexity of the file and, where llama-quantize can requantize it to F32, its KL
    divergence from that F32 copy (the same weights, dequantized)."""
    def perplexity(model: Path, *extra: str) -> str:
        out = subprocess.run([str(bin_dir / "llama-perplexity"), "-m", str(model), "-f", str(text), "-c", str(ctx),
                               "-b", str(ctx), "-t", str(threads), *extra], capture_output=True, text=True, check=True)
        return out.stdout + out.stderr

    def number(pattern: str, output: str) -> float:
        found = re.search(pattern, output)
        if found is None:
            raise RuntimeError(f"llama-perplexity printed no {pattern!r}:\n{output[-2000:]}")
        return float(found.group(1))

    if not (bin_dir / "llama-quantize").exists():
        return {"perplexity": number(r"Final estimate: PPL = ([0-9.]+)", perplexity(gguf))}
    with tempfile.TemporaryDirectory() as scratch:
        f32, base = Path(scratch) / "f32.gguf", Path(scratch) / "base.kld"
        subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(gguf), str(f32), "F32"],
                       capture_output=True, text=True, check=True)
        exact = number(r"Final estimate: PPL = ([0-9.]+)", perplexity(f32, "--kl-divergence-base", str(base)))
        out = perplexity(gguf, "--kl-divergence-base", str(base), "--kl-divergence")
    return {"perplexity": number(r"Mean PPL\(Q\)\s*:\s*([0-9.]+)", out), "float32 perplexity": exact,
            "kl_divergence": number(r"Mean\s+KLD:\s*([0-9.]+)", out),
            "same_top": number(r"Same top p:\s*([0-9.]+)", out) / 100}


def llama_tokens(binary: Path, gguf: Path, text: Path) -> list[int]:
    out = subprocess.run([str(binary), "-m", str(gguf), "-f", str(text), "--ids", "--log-disable"],
                         capture_output=True, text=True, check=True).stdout
    return [int(t) for t in re.findall(r"-?\d+", out.strip().splitlines()[-1])]


def run(args: argparse.Namespace) -> dict:
    from engine.tokenizer import Tokenizer
    from weights.resolve import resolve_model

    threads = args.threads or torch.get_num_threads()
    tokenizer = Tokenizer.from_dir(resolve_model(str(args.gguf), progress=False))
    source = args.text.read_text() if args.text else TEXT
    ids = tokenizer.encode(source)
    bos = ids[0] if len(ids) > len(tokenizer.encode(source, add_special_tokens=False)) else None
    if len(ids) < 2 * args.ctx:
        raise SystemExit(f"the text is {len(ids)} tokens: llama-perplexity needs at least {2 * args.ctx} for --ctx {args.ctx}")
    payload = {"machine": machine(), "threads": threads, "file": args.gguf.name, "ctx": args.ctx,
               "text": args.text.name if args.text else "the built-in paragraphs", "tokens": len(ids),
               "chunks": len(ids) // args.ctx, "kvserve": kvserve_scores(args.gguf, ids, args.ctx, bos)}
    if args.llama_bin:
        with tempfile.TemporaryDirectory() as scratch:
            text = Path(scratch) / "text.txt"
            text.write_text(source)
            tokenize = args.llama_bin / "llama-tokenize"
            if tokenize.exists():
                payload["same_tokens"] = llama_tokens(tokenize, args.gguf, text) == ids
            payload["llama.cpp"] = llama_scores(args.llama_bin, args.gguf, text, args.ctx, threads)
    table = rendered(payload)
    write_results(args.out, "perplexity", payload, table)
    print(table)
    return payload


def rendered(payload: dict) -> str:
    def row(name: str, scores: dict) -> list[str]:
        optional = lambda key, form: form.format(scores[key]) if key in scores else ""
        return [name, f"{scores['perplexity']:.4f}", optional("float32 perplexity", "{:.4f}"),
                optional("kl_divergence", "{:.6f}"), optional("same_top", "{:.1%}")]

    rows = [row("kvserve", payload["kvserve"])]
    if "llama.cpp" in payload:
        rows.append(row("llama.cpp", payload["llama.cpp"]))
        ratio = payload["kvserve"]["perplexity"] / payload["llama.cpp"]["perplexity"]
        versus = f"kvserve's perplexity {100 * (ratio - 1):+.2f}% of llama.cpp's"
    else:
        versus = "llama.cpp not run"
    same = {True: "the same on both sides", False: "NOT the same on both sides", None: "not compared"}[
        payload.get("same_tokens")]
    return (f"{machine_line(payload['machine'])}, {payload['threads']} threads\n\n{payload['file']}, {payload['text']}: "
            f"{payload['tokens']} tokens ({same}), {payload['chunks']} chunks of {payload['ctx']}, the second half of each scored; {versus}\n\n"
            + markdown_table(["", "perplexity", "the file's weights in float32", "KL divergence from float32",
                              "same top token"], rows))
