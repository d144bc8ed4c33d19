"""How often prompt lookup is right on real text (`python -m bench.lookup_replay`).

Random-weight models decide nothing about acceptance. Here real edits stand in
for a model's output: each commit of a git repository that changed a source
file is a request whose answer is the file as the commit left it, as a model
editing code writes it out in full. The worker's own proposer (`RowDrafts`,
with other streams' recent tokens where `shared`) proposes at each step;
a proposal is kept for as long as it equals the real next tokens, as a
greedy model that wrote exactly this would keep it. Two workloads:

- edit: the prompt holds the file as it was (a code edit, a summary quoting
  its document): lookups find most of the answer in the prompt.
- rewrite: the prompt holds only the commit's message (an agent writing out a
  file another session wrote before): the answer's earlier versions are only
  in other streams' tokens, each finished stream's last 512 there.

Tokens are a byte-level BPE trained on the files themselves. Reported:
tokens a checking pass returns (what a pass gains where checking costs what
a plain pass does), the share of steps that proposed, and what was kept.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from smg_mlx.engine.speculative.prompt_lookup import RowDrafts
from smg_mlx.engine.speculative.shared_history import SharedHistory
from smg_mlx.flag_types import positive

WORKLOADS = ("edit", "rewrite")
LARGEST_FILE = 40_000  # characters: a request of a few thousand tokens at most


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                          check=True).stdout  # fmt: skip


def edits(repo: Path, suffix: str, most: int) -> list[tuple[str, str, str]]:
    """Up to `most` (message, file before, file after) of the repository's
    commits that changed a file ending in `suffix`, oldest first."""
    found = []
    log = _git(repo, "log", "--reverse", "--format=%H", "--diff-filter=M", "--", f"*{suffix}")
    for commit in log.split():
        message = _git(repo, "log", "-1", "--format=%B", commit)
        changed = _git(repo, "diff", "--name-only", f"{commit}^", commit, "--", f"*{suffix}")
        for name in changed.split():
            try:
                before = _git(repo, "show", f"{commit}^:{name}")
                after = _git(repo, "show", f"{commit}:{name}")
            except subprocess.CalledProcessError:  # added, removed or renamed
                continue
            if 0 < len(after) <= LARGEST_FILE and before != after:
                found.append((message, before, after))
        if len(found) >= most:
            break
    return found[:most]


def tokenizer_for(texts: list[str], vocab: int) -> Tokenizer:
    """A byte-level BPE of `vocab` tokens trained on `texts`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def replay(prompt: list[int], answer: list[int], most: int, shared: SharedHistory | None) -> dict:
    """One request decoded with the worker's proposer against its real answer."""
    row = RowDrafts(most, shared=shared)
    tokens = list(prompt)
    done = steps = checking = proposed = kept = 0
    while done < len(answer):
        steps += 1
        pending, rest = answer[done], answer[done + 1 :]
        proposal = row.propose(steps, pending, most) if row.likely(steps, tokens) else []
        proposal = proposal[: len(rest)]
        n = 0
        while n < len(proposal) and proposal[n] == rest[n]:
            n += 1
        if proposal:
            row.fared(steps, len(proposal), n)
            checking += 1
            proposed += len(proposal)
            kept += n
        tokens += answer[done : done + 1 + n]
        done += 1 + n
    if shared is not None:
        shared.add(tokens)
    return {"tokens": len(answer), "passes": steps, "checking": checking,
            "proposed": proposed, "kept": kept}  # fmt: skip


def run(repo: Path, suffix: str, requests: int, most: int, vocab: int) -> list[dict]:
    """Each workload, with and without other streams' tokens: what lookups did."""
    found = edits(repo, suffix, requests)
    tokenizer = tokenizer_for([after for _, _, after in found], vocab)
    encoded = [[tokenizer.encode(text).ids for text in edit] for edit in found]
    rows = []
    for workload in WORKLOADS:
        for use_shared in (False, True):
            shared = SharedHistory() if use_shared else None
            total = {"tokens": 0, "passes": 0, "checking": 0, "proposed": 0, "kept": 0}
            for message, before, after in encoded:
                prompt = message + before if workload == "edit" else message
                for key, value in replay(prompt, after, most, shared).items():
                    total[key] += value
            rows.append({"workload": workload, "shared": use_shared, "requests": len(found),
                         **total})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.lookup_replay", description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )  # fmt: skip
    p.add_argument("--repo", type=Path, default=Path("."), help="a git repository")
    p.add_argument("--suffix", default=".py", help="the files whose edits are replayed")
    p.add_argument("--requests", type=positive, default=200,
                   help="edits replayed, oldest first")
    p.add_argument("--num-draft-tokens", type=int, default=8, help="the most a step proposes")
    p.add_argument("--vocab", type=int, default=8192, help="the BPE's tokens")
    p.add_argument("--out", type=Path, help="JSON results")
    args = p.parse_args(argv)
    if not (args.repo / ".git").exists():
        p.error(f"--repo {args.repo}: not a git repository (its top folder)")
    rows = run(args.repo, args.suffix, args.requests, args.num_draft_tokens, args.vocab)
    if not rows or not rows[0]["requests"]:
        p.error(f"--suffix {args.suffix}: no edits of such files in {args.repo}'s history")
    for r in rows:
        print(f"{r['workload']:8s} {'with' if r['shared'] else 'without':7s} other streams: "
              f"{r['tokens'] / r['passes']:.2f} tokens a pass over {r['requests']} requests, "
              f"{r['checking'] / r['passes']:.0%} of steps proposed, "
              f"{r['kept']} of {r['proposed']} proposed kept", flush=True)  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps({"command": sys.argv, "results": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
