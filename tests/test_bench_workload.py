"""The bench's workload: answers of several lengths (--gen-spread), the same in
every system."""

from __future__ import annotations

from mlx_lm.generate import BatchGenerator
from test_speculative import tiny_model

from bench.engine_raw import _closed_loop
from bench.workload import Workload


def test_answers_spread_around_gen_tokens_and_the_raw_engine_gives_each_its_length():
    workload = Workload(prompt_tokens=8, gen_tokens=12, gen_spread=8)
    lengths = [workload.answer_tokens(i) for i in range(12)]
    assert lengths == [workload.answer_tokens(i) for i in range(12)]  # every system's
    assert all(4 <= n <= 20 for n in lengths) and len(set(lengths)) > 3
    assert Workload(gen_tokens=12).answer_tokens(5) == 12  # no spread: all the same

    model = tiny_model("llama", scale=1.5)
    generator = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=4)
    records, _ = _closed_loop(generator, workload, 4, range(12))
    generator.close()
    assert not [r.error for r in records if r.error]
    assert sorted(r.tokens for r in records) == sorted(lengths)
