"""Speculative decoding inside the running batch (engine thread only).

Each decoding row may propose the tokens it expects next (`prompt_lookup`:
the continuation of an earlier occurrence of its last tokens in its own
prompt and output, else in other streams' recent tokens, `shared_history`;
or `draft_model`: a small model's greedy continuation).
One pass over the model checks every row's proposals at once (`decoding`);
each row keeps the proposals its own sample agrees with, plus the token the
model chose after them, and takes the rest back from its cache
(`ragged_kv`: rows of one batch may end at different columns). Rows without
proposals decode in the same pass. `pacing` decides from timed runs of passes
whether a wider pass pays, and each row's proposals adapt to how many of
them were right.

May import mlx, mlx-lm, numpy and the batch's cache classes (engine.batch's
`quantized_kv`, `row_places`); imported by the batch (engine.batch) alone.
"""
