"""Passes bounded in time, fairly: the cost model, the scheduler under a time budget, and the
engine stepped by hand (`hold()` + `step()`). No clock is raced: every budget here is a cost
model whose numbers are given, so what a pass holds is decided by arithmetic, not by this
machine's speed."""

from __future__ import annotations

import math
import random

import pytest
import torch
from conftest import QUESTIONS, chat, tiny_model

from kev_engine import Engine, SamplingParams
from kev_engine.core import pass_cost
from kev_engine.core.blocks import BlockManager
from kev_engine.core.latency import Histogram, merged
from kev_engine.core.pass_cost import GROWTH, CostModel, Work, pairs, target_ms
from kev_engine.core.plan import ALONE_FACTOR, FIRST_PASS_TOKENS, MIN_CHUNK, Chunk
from kev_engine.core.request import Request
from kev_engine.core.schedule import LEAST_SHARE, LONG_SHARE, Scheduler
from kev_engine.platforms.cpu.platform import CpuPlatform
from kev_engine.platforms.cuda.platform import CudaPlatform
from kev_integrations.server.metrics import Metrics

MS_PER_TOKEN = Work(per_token=1.0, per_row=0.0, per_pair=0.0)  # one flop a token: seconds_per_flop is per token


def per_token(ms: float) -> CostModel:
    return CostModel(MS_PER_TOKEN, seconds_per_flop=ms / 1000, learn=False)


def request(i: int, length: int, max_tokens: int = 4, group: int | None = None) -> Request:
    """Request i, a group of its own unless given one (a submitted batch shares its group)."""
    prompt = [1000 * (i + 1) + t for t in range(length)]  # no two requests share a block
    return Request(request_id=i, prompt_ids=prompt, sampling=SamplingParams(temperature=0, max_tokens=max_tokens),
                   settings_version=0, max_total=length + max_tokens, group=i if group is None else group)


def scheduler(budget_ms: float = 100.0, ms: float = 1.0, max_num_seqs: int = 16) -> Scheduler:
    """1 ms a token, `budget_ms` a pass: `budget_ms / ms` tokens fit a pass."""
    return Scheduler(max_batch_tokens=8192, max_num_seqs=max_num_seqs, blocks=BlockManager(4096, 16),
                     cost=per_token(ms), pass_time_s=budget_ms / 1000)


def drew(chunks: list[Chunk]) -> None:
    """Token 7 for each chunk that reaches its request's end (the engine's records append it)."""
    for chunk in chunks:
        if chunk.needs_logits:
            chunk.request.output_ids.append(7)


def run(s: Scheduler) -> dict[Request, int]:
    """One pass: its chunks applied, a token drawn for each chunk that reaches its request's end."""
    chunks = s.schedule()
    s.update(chunks)
    drew(chunks)
    for c in chunks:
        if c.needs_logits and len(c.request.output_ids) >= c.request.sampling.max_tokens:
            s.finish([c.request])
    return {c.request: c.num_tokens for c in chunks}


# ---- the cost model ----------------------------------------------------------------------------


def test_the_fit_recovers_a_fixed_part_and_the_rates_of_products_and_attention() -> None:
    model = CostModel(Work(2.0, 10.0, 0.5))
    assert not model.ready
    for dense, attention in ((1e6, 0.0), (5e6, 1e6), (2e7, 3e5), (3e5, 4e6), (8e6, 8e6), (1e7, 0.0)):
        model.observe(dense, attention, 0.004 + 2e-9 * dense + 1e-8 * attention)  # attention 5x slower a flop
    assert model.ready
    assert model.fixed_s == pytest.approx(0.004) and model.seconds_per_flop == pytest.approx(2e-9)
    assert model.attention_ratio == pytest.approx(5.0)
    assert model.units(10, 1, 100) == pytest.approx(2.0 * 10 + 10.0 + 5.0 * 0.5 * 100)
    assert model.predict(1e7) == pytest.approx(0.024)


def test_one_pass_or_passes_of_one_size_give_a_rate_through_the_origin() -> None:
    model = CostModel(MS_PER_TOKEN)
    model.observe(1000, 0.0, 0.5)
    assert (model.fixed_s, model.seconds_per_flop) == (0.0, pytest.approx(0.0005))
    model.observe(1000, 0.0, 0.7)  # the same work twice: no spread to fit a slope on
    assert model.fixed_s == 0.0 and model.seconds_per_flop == pytest.approx(0.0006)
    frozen = per_token(2.0)
    frozen.observe(10, 0.0, 99.0)
    assert frozen.seconds_per_flop == 0.002  # learn=False never moves


def test_a_pass_holds_at_most_growth_times_the_work_per_second_of_the_best_pass_timed() -> None:
    """Passes that all took about the target (the scheduler fills them) leave the fit's fixed part
    free to swing: here one says a token is almost free. The plan is bounded by what the timed
    passes did per second; a fit that stays within that bound is taken as it is."""
    model = CostModel(MS_PER_TOKEN)
    for tokens in (38, 41, 40, 39, 42):
        model.observe(tokens, 0.0, 0.1)  # every pass a tenth of a second: 420 tokens a second at best
    model.fixed_s, model.seconds_per_flop = 0.099, 1e-6  # a swing: 0.1 ms of the pass for a million tokens
    assert model.flops_within(0.1 - model.fixed_s) == pytest.approx(1000)
    assert model.pass_flops(0.1) == pytest.approx(GROWTH * 420 * 0.1)
    model.fixed_s, model.seconds_per_flop = 0.0, 0.1 / 40  # a fit within the bound: its own answer
    assert model.pass_flops(0.1) == pytest.approx(40)
    assert CostModel(MS_PER_TOKEN, seconds_per_flop=0.001, learn=False).pass_flops(0.1) == pytest.approx(100)


def test_after_decode_steps_alone_a_pass_holds_what_a_first_pass_holds() -> None:
    """Decode steps (one row each, mostly their fixed part) say little about a full pass: from them
    the fit may reach as far as it likes (here it says 270 rows fit), and the best of them bounds a
    pass at 41 rows. The bound is never below `at_least`, what a first pass holds before any was
    timed, so the next prompt is not cut into pieces of a few tokens."""
    model = CostModel(MS_PER_TOKEN)
    for rows in (1, 2, 1, 3, 2):
        model.observe(rows, 0.0, 0.030 + 0.001 * rows)  # 30 ms fixed, 1 ms a row
    assert model.flops_within(0.3 - model.fixed_s) == pytest.approx(270)
    assert model.pass_flops(0.3) == pytest.approx(GROWTH * 3 / 0.033 * 0.3)  # about 41
    assert model.pass_flops(0.3, at_least=256) == pytest.approx(256)
    model.observe(200, 0.0, 0.2)  # a pass of two-thirds of the target: 1,000 rows a second, the bound
    model.fixed_s, model.seconds_per_flop = 0.0, 1e-6  # a swing of the fit
    assert model.pass_flops(0.3, at_least=256) == pytest.approx(GROWTH * 1000 * 0.3)


@pytest.mark.parametrize("anchors", [pass_cost.ANCHORS, 0])  # 0: the control, the window alone
def test_a_prompt_timed_before_an_answers_decode_steps_still_sizes_the_next_pass(monkeypatch, anchors: int) -> None:
    """A lone question (the embedded model's shapes, about its timings on a 2-core CPU): its
    132-token prompt took 150 ms, then 40 decode steps filled the window, one row each, the time
    drifting up by 0.04 ms a step as the attention grows a token's worth. Fitted on the window
    alone, that drift is the only slope there is: a prompt then costs 2.5 s, and the next
    question's 132 tokens would be cut into passes. The anchors keep the prompt's pass in the fit."""
    monkeypatch.setattr(pass_cost, "ANCHORS", anchors)
    work = Work(per_token=2.1e8, per_row=5.7e7, per_pair=2.2e5)
    model = CostModel(work)
    prompt = 132
    model.observe(work.dense(prompt, 1), work.per_pair * pairs(0, prompt), 0.150)
    for step in range(40):
        model.observe(work.dense(1, 1), work.per_pair * pairs(prompt + step, 1), 0.026 + 0.00004 * step)
    need = model.units(prompt, 1, pairs(0, prompt))
    fits = model.pass_flops(0.6, at_least=model.units(FIRST_PASS_TOKENS, 1, 0)) >= need
    assert fits == bool(anchors)
    if anchors:
        assert model.predict(need) == pytest.approx(0.150, rel=0.01)


def test_passes_of_decode_steps_alone_fit_nothing_and_a_prompt_reads_a_fresh_fit(monkeypatch) -> None:
    """The fit runs when a pass first needs a prediction after a pass was observed: decode steps
    alone need none (each takes its token whatever the budget), a waiting prompt does, and then
    sees every pass observed so far. Control: the fit does run for the prompt's pass."""
    fits: list[int] = []
    real_fit = pass_cost._fit
    monkeypatch.setattr(pass_cost, "_fit", lambda points: fits.append(len(points)) or real_fit(points))
    s = Scheduler(max_batch_tokens=8192, max_num_seqs=16, blocks=BlockManager(4096, 16),
                  cost=CostModel(MS_PER_TOKEN), pass_time_s=0.1)
    answers = [request(i, 20, max_tokens=12) for i in range(3)]
    s.add(answers)
    timed = 0
    while any(r.in_prefill for r in answers) or timed < 8:  # the prompts, then decode steps alone
        chunks = s.schedule()
        s.update(chunks, seconds=0.001 * (1 + timed))
        drew(chunks)
        timed += 1
    assert fits == [] and s.cost is not None and s.cost.ready  # observed, never fitted: nothing asked
    s.add([request(9, 400)])
    s.schedule()
    assert fits == [timed]  # one fit, over every pass observed
    assert s.cost.seconds_per_flop is not None and s.cost.seconds_per_flop > 0
    assert fits == [timed]  # read again: the same fit


def test_tokens_within_is_the_longest_chunk_whose_work_fits() -> None:
    model = CostModel(Work(per_token=3.0, per_row=50.0, per_pair=0.25), seconds_per_flop=1.0)
    for past in (0, 7, 300):
        for flops in (0.0, 49.0, 60.0, 1234.5, 98765.0):
            take = model.tokens_within(flops, past, rows=1)
            def work(n: int, past: int = past) -> float:
                return 3.0 * n + 50.0 + 0.25 * pairs(past, n)

            assert take == 0 or work(take) <= flops
            assert work(take + 1) > flops
    assert pairs(0, 4) == 10 and pairs(5, 2) == 13  # 1+2+3+4; 6+7


def test_work_counts_the_models_own_layers(tokenizer) -> None:
    model = tiny_model("llama", tokenizer)
    work = Work.of(model)
    config = model.config
    head = model.lm_head.weight.numel()
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)) - head
    assert work.per_token == 2 * linear and work.per_row == 2 * head
    assert work.per_pair == 4 * config.num_attention_heads * config.head_dim * config.num_hidden_layers


def test_histograms_count_by_upper_bound_and_merge() -> None:
    first, second = Histogram((0.1, 1.0)), Histogram((0.1, 1.0))
    for seconds in (0.05, 0.1, 0.5, 3.0):
        first.observe(seconds)
    second.observe(0.2)
    assert first.snapshot() == {"count": 4, "sum": 3.65, "max": 3.0, "buckets": [[0.1, 2], [1.0, 3], ["+Inf", 4]]}
    assert merged([first.snapshot(), second.snapshot()])["buckets"] == [[0.1, 2], [1.0, 4], ["+Inf", 5]]


def test_pass_time_ms_is_checked_and_has_a_default_per_platform(monkeypatch) -> None:
    monkeypatch.delenv("KEV_PASS_TIME_MS", raising=False)
    cpu, cuda = CpuPlatform.default_pass_ms, CudaPlatform.default_pass_ms
    assert target_ms(None, cpu) == 300.0 and target_ms(None, cuda) == 100.0
    assert target_ms(50, cpu) == 50.0 and target_ms(math.inf, cpu) == math.inf
    for bad in (0, -5, "fast", True, float("nan")):
        with pytest.raises(ValueError, match=rf"pass_time_ms={bad!r} is not allowed; use a number of milliseconds"):
            target_ms(bad, cpu)  # type: ignore[arg-type]
    monkeypatch.setenv("KEV_PASS_TIME_MS", "inf")
    assert target_ms(None, cpu) == math.inf and target_ms(20, cpu) == 20.0
    monkeypatch.setenv("KEV_PASS_TIME_MS", "soon")
    with pytest.raises(ValueError, match="KEV_PASS_TIME_MS='soon' is not allowed"):
        target_ms(None, cpu)


# ---- the scheduler under a time budget ---------------------------------------------------------


def test_a_batch_whose_work_fits_the_budget_is_one_pass() -> None:
    s = scheduler(budget_ms=100)
    group = [request(i, 20, group=7) for i in range(4)]  # 80 tokens: 80 ms
    s.add(group)
    assert run(s) == {r: 20 for r in group}


def test_a_larger_batch_runs_in_consecutive_passes_its_questions_together_and_first() -> None:
    s = scheduler(budget_ms=100)
    group = [request(i, 60, group=7) for i in range(4)]  # 240 tokens: three passes
    later = request(9, 10)
    s.add(group)
    s.add([later])
    passes = [run(s) for _ in range(3)]
    assert all(sum(p.values()) <= 100 for p in passes[:2])
    assert passes[0] == {group[0]: 60, group[1]: 40}
    assert all(r.num_computed >= 60 for r in group)  # the whole group prefilled in three passes
    assert later not in passes[0] and later not in passes[1]  # the later group only after it


def test_a_short_prompt_queued_behind_a_long_one_is_admitted_in_the_next_pass() -> None:
    s = scheduler(budget_ms=100)
    long_one = request(0, 5000)
    s.add([long_one])
    assert run(s) == {long_one: int(100 * ALONE_FACTOR)}  # alone, it may take ALONE_FACTOR targets
    short = request(1, 12)
    s.add([short])
    second = run(s)
    assert second[short] == 12 and second[long_one] == 88  # the short one whole, the long one the rest
    assert short.output_ids == [7]  # its first token, in the very next pass
    third = run(s)
    assert third == {short: 1, long_one: 99}  # decode first, then the long prompt goes on


def test_every_running_answer_gets_its_token_in_every_pass_and_a_long_prompt_still_moves() -> None:
    s = scheduler(budget_ms=40, max_num_seqs=64)
    answering = [request(i, 8, max_tokens=1000) for i in range(50)]  # 50 decodes outweigh the budget
    s.add(answering)
    while any(r.in_prefill for r in answering):
        run(s)
    long_one = request(99, 400)
    s.add([long_one])
    for _ in range(5):
        ran = run(s)
        assert all(ran[r] == 1 for r in answering)
        assert ran[long_one] == MIN_CHUNK  # no time left after the decodes: the least, never nothing


def test_a_short_prompt_that_fits_beside_the_long_ones_least_finishes_in_the_pass_it_is_admitted_in() -> None:
    """A waiting prompt that fits in what is left after the long prompt's least (LEAST_SHARE of the
    pass here, less than MIN_CHUNK tokens) is admitted whole: its first token comes one pass after
    it arrived, not two; the long one keeps the rest. One token more is the next test's case."""
    s = scheduler(budget_ms=100)
    long_one = request(0, 5000)
    s.add([long_one])
    run(s)
    least = int(LEAST_SHARE * 100)
    assert least < MIN_CHUNK
    short = request(1, 100 - least)
    s.add([short])
    assert run(s) == {long_one: least, short: 100 - least}
    assert short.output_ids == [7]
    assert run(s) == {short: 1, long_one: 99}


def test_a_short_prompt_admitted_in_part_is_not_held_behind_the_long_one_under_way() -> None:
    """A waiting prompt too long to finish beside the long one's least shares the pass (the long
    one keeps LONG_SHARE); prompts under way then go shortest-left first, so it finishes its
    prefill in the next pass instead of waiting for the long prompt admitted before it."""
    s = scheduler(budget_ms=100)
    long_one = request(0, 5000)
    s.add([long_one])
    run(s)
    short = request(1, 100 - int(LEAST_SHARE * 100) + 1)  # one token more than fits beside the long one's least
    s.add([short])
    assert run(s) == {long_one: 50, short: 50}  # the long one keeps LONG_SHARE: the short one gets the rest
    assert run(s) == {short: 41, long_one: 59}  # now both are under way: the short one's rest first
    assert short.output_ids == [7]


@pytest.mark.parametrize("queue_first", [True, False], ids=["queue-first", "control-second-long-first"])
def test_a_short_prompt_is_not_held_behind_two_long_ones_under_way(queue_first: bool,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Two long prompts under way and a short one waiting that fits beside them: it finishes in this
    pass, the other long prompt (the shorter left) goes on with the rest of the pass, and the
    longest keeps its least. The control, without the queue's need counted, gives the long ones
    LONG_SHARE each and the short one only MIN_CHUNK."""
    s = scheduler(budget_ms=100)
    first, second = request(0, 5000), request(1, 4000)
    s.add([first])
    run(s)
    s.add([second])
    run(s)
    assert not first.output_ids and not second.output_ids and second.num_computed > 0
    short = request(2, 30)
    s.add([short])
    if not queue_first:
        monkeypatch.setattr(s, "_waiting_flops", lambda running, plan: 0.0)
    ran = run(s)
    least = int(LEAST_SHARE * 100)  # the longest's least: the short one fits beside it and the other's share
    assert ran == ({first: least, second: 100 - least - 30, short: 30} if queue_first
                   else {first: 50, second: 50, short: MIN_CHUNK})


@pytest.mark.parametrize("queue_first", [True, False], ids=["queue-first", "control-min-chunk"])
def test_a_long_prompt_far_along_moves_by_less_than_min_chunk_while_a_short_one_waits(
        queue_first: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prompt under way with the least left is long too and far along: each of its tokens
    attends to 4,050 earlier ones (6 ms here). Its MIN_CHUNK would fill the pass; while a short
    prompt waits it moves by what is left after the queue, a token at least (the control, without
    the queue's need, gives it MIN_CHUNK and the short one MIN_CHUNK)."""
    s = scheduler(budget_ms=2000)
    far, new = request(0, 5000), request(1, 4000)
    s.add([far])
    run(s)
    s.pass_time_s = 0.1
    s.add([new])
    run(s)
    assert (far.num_computed, new.num_computed) == (4050, 50)
    s.cost = CostModel(Work(per_token=1.0, per_row=0.0, per_pair=5.0 / far.num_computed),
                       seconds_per_flop=0.001, learn=False)
    short = request(2, 30)
    s.add([short])
    if not queue_first:
        monkeypatch.setattr(s, "_waiting_flops", lambda running, plan: 0.0)
    ran = run(s)
    if queue_first:
        assert ran[short] == 30 and 1 <= ran[far] < MIN_CHUNK and ran[new] >= 1
    else:
        assert ran == {far: MIN_CHUNK, new: MIN_CHUNK, short: MIN_CHUNK}


def test_when_a_pass_is_mispredicted_to_hold_nothing_the_queue_still_moves() -> None:
    """A cost model that thinks even one token overruns the pass (a long past's attention, a slow
    machine): the oldest prompt under way and the first waiting one each still get MIN_CHUNK."""
    s = scheduler(budget_ms=100)
    long_one = request(0, 5000)
    s.add([long_one])
    run(s)
    assert s.cost is not None
    s.cost.seconds_per_flop = 10.0  # ten seconds a token, from now on
    shorts = [request(1, 40), request(2, 40)]
    s.add(shorts)
    ran = run(s)
    assert ran == {long_one: MIN_CHUNK, shorts[0]: MIN_CHUNK}  # the second short waits for the next pass


def test_a_long_prompt_finishes_under_a_stream_of_short_ones() -> None:
    s = scheduler(budget_ms=100)
    long_one = request(0, 1000)
    s.add([long_one])
    run(s)
    passes = 0
    rng = random.Random(0)
    while long_one.in_prefill:
        s.add([request(1000 + passes * 10 + k, rng.randint(30, 60), max_tokens=2) for k in range(3)])  # > budget
        before, decodes = long_one.num_computed, len(s.running) - 1
        run(s)
        passes += 1
        share = int(LONG_SHARE * (100 - decodes))  # half of what the running answers' tokens leave
        assert long_one.num_computed - before >= min(share, 1000 - before)  # its share at least
    assert passes <= 1000 // int(LONG_SHARE * 100) + 2


def shared_request(i: int, prefix: list[int], own: int, group: int = 5) -> Request:
    """Request i: `prefix`, then `own` tokens no other request has."""
    prompt = prefix + [100_000 * (i + 1) + t for t in range(own)]
    return Request(request_id=i, prompt_ids=prompt, sampling=SamplingParams(temperature=0, max_tokens=2),
                   settings_version=0, max_total=len(prompt) + 2, group=group)


def prefill_tokens(s: Scheduler, requests: list[Request]) -> int:
    """Run passes until every request has its first token: the prompt tokens computed (each
    request's prompt less what it found cached; the pool never preempts here)."""
    while any(not r.output_ids for r in requests):
        run(s)
    return sum(len(r.prompt_ids) - r.cached_tokens for r in requests)


@pytest.mark.parametrize("waits", [True, False], ids=["waits", "control-computes-twice"])
def test_questions_on_one_document_wait_for_it_instead_of_computing_it_twice(waits: bool,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Twenty questions on one 320-token document, passes of 100 tokens: the first question computes
    the document in chunks, the others wait for it and start after it, cached. The control turns
    the waiting off: then the questions admitted beside the first compute the document again."""
    if not waits:
        monkeypatch.setattr(Scheduler, "_waits_for_prefix", lambda self, request, plan, cached: False)
    s = scheduler(budget_ms=100)
    document = [7 + t for t in range(320)]  # 20 full blocks of 16
    questions = [shared_request(i, document, own=10) for i in range(20)]
    s.add(questions)
    computed = prefill_tokens(s, questions)
    once = 330 + 19 * 10  # the document once, each question's own tokens once
    if waits:
        assert computed == once
        assert [q.cached_tokens for q in questions[1:]] == [320] * 19
    else:
        assert computed > once


def test_sharing_only_a_system_prompt_with_a_long_prompt_under_way_does_not_wait() -> None:
    """The shared blocks are computed in the long prompt's first pass: a short question after them
    is admitted in the very next pass, as any other (fair admission holds)."""
    s = scheduler(budget_ms=100)
    system = [3 + t for t in range(32)]  # two full blocks
    long_one = shared_request(0, system, own=5000, group=1)
    s.add([long_one])
    run(s)
    short = shared_request(1, system, own=12, group=2)
    s.add([short])
    second = run(s)
    assert second[short] == 12 and short.cached_tokens == 32 and short.output_ids == [7]


def test_shared_blocks_counts_equal_leading_blocks_up_to_a_limit() -> None:
    from kev_engine.core.schedule import shared_blocks

    a = list(range(100))
    assert shared_blocks(a, list(a), 16, 99) == 6  # six full blocks, the partial seventh not counted
    assert shared_blocks(a, list(a), 16, 4) == 4
    for mismatch in (0, 15, 16, 50, 95):
        b = list(a)
        b[mismatch] = -1
        assert shared_blocks(a, b, 16, 99) == min(mismatch // 16, 6), mismatch
    assert shared_blocks(a, a[:40], 16, 99) == 2


def test_before_any_pass_is_timed_a_pass_is_short_and_an_infinite_budget_leaves_the_token_cap() -> None:
    fresh = Scheduler(max_batch_tokens=8192, max_num_seqs=8, blocks=BlockManager(1024, 16),
                      cost=CostModel(MS_PER_TOKEN), pass_time_s=0.1)  # nothing timed yet
    long_one = request(0, 3000)
    fresh.add([long_one])
    assert run(fresh) == {long_one: FIRST_PASS_TOKENS}  # however slow this machine, the first pass is short
    assert fresh.planned == (float(FIRST_PASS_TOKENS), 0.0)  # and what it ran teaches the model
    unbounded = scheduler(budget_ms=math.inf)
    other = request(1, 3000)
    unbounded.add([other])
    assert run(unbounded) == {other: 3000}


def test_the_scheduler_teaches_the_cost_model_each_pass() -> None:
    s = Scheduler(max_batch_tokens=8192, max_num_seqs=8, blocks=BlockManager(1024, 16),
                  cost=CostModel(MS_PER_TOKEN), pass_time_s=0.1)
    s.add([request(0, 500)])
    chunks = s.schedule()
    s.update(chunks, seconds=0.512)  # 256 tokens in 0.512 s: 2 ms a token
    assert s.cost is not None and s.cost.seconds_per_flop == pytest.approx(0.002)
    s.add([request(1, 500)])
    assert sum(c.num_tokens for c in s.schedule()) == 50  # 100 ms at 2 ms a token (two batches: not alone)


# ---- the engine, stepped by hand: the transformers fallback, whose passes cannot pause, cuts a batch
# into passes of the budget (Kev's own model pauses a whole pass instead: test_paused_pass.py) ----


def budget_engine(tokenizer, budget_ms: float, ms: float, **kwargs) -> Engine:
    kwargs.setdefault("model_impl", "transformers")
    engine = Engine(tiny_model("llama", tokenizer), tokenizer, pass_time_ms=budget_ms, **kwargs)
    engine._scheduler.cost = per_token(ms)
    return engine


def step_until_done(engine: Engine, futures, on_pass=lambda: None) -> int:
    """Passes by hand until nothing is left to run, then each result (delivered by the engine's
    delivery threads, right after the pass that finished it)."""
    passes = 0
    while engine.has_work():
        on_pass()
        assert engine.step() > 0
        passes += 1
    for future in futures:
        future.result(timeout=60)
    return passes


def test_through_the_engine_a_short_question_starts_in_the_pass_after_it_arrives(tokenizer) -> None:
    engine = budget_engine(tokenizer, budget_ms=200, ms=1.0)  # 200 tokens a pass
    try:
        document = "The lighthouse keeper logged every ship that passed the granite point. " * 80
        long_prompt = chat("Summarise the log.", document)
        assert len(engine.encode(long_prompt)) > 1000
        with engine.hold():
            slow = engine.submit(long_prompt, SamplingParams(temperature=0, max_tokens=2))
            assert engine.step() == 400  # alone: ALONE_FACTOR targets
            quick = engine.submit(QUESTIONS[0], SamplingParams(temperature=0, max_tokens=1))
            short = len(engine.encode(QUESTIONS[0]))
            assert engine.step() == 200  # the short prompt whole, the long one the rest
            # one token asked, one pass run since it arrived (and none can run while held): answered
            assert quick.result(timeout=60).completion_tokens == 1
            assert engine._scheduler.running[0].num_computed == 600 - short
            step_until_done(engine, [slow])
        stats = engine.stats()
        assert stats["pass_time_ms"] == 200.0 and stats["prefill_passes"] >= 3
        assert stats["pass_seconds"]["count"] == stats["forward_passes"]
        assert stats["queue_seconds"]["count"] == stats["requests"] == 2
        assert stats["pass_seconds"]["buckets"][-1] == ["+Inf", stats["forward_passes"]]
        text = Metrics().render(stats).decode()
        assert "kev_pass_target_seconds 0.2\n" in text
        assert f'kev_pass_duration_seconds_bucket{{le="+Inf"}} {stats["forward_passes"]:.1f}\n' in text
        assert "kev_queue_delay_seconds_count 2.0\n" in text
    finally:
        engine.close()


def test_packed_equals_alone_bitwise_while_the_budget_changes_mid_prompt(tokenizer) -> None:
    """Chunk boundaries move with the budget (a different one every pass): each question's tokens
    and logits stay bitwise those it gets alone in an engine bounded by tokens only."""
    from test_invariance import alone, questions

    budgets = random.Random(3)
    engine = budget_engine(tokenizer, budget_ms=50, ms=1.0)
    whole = Engine(tiny_model("llama", tokenizer), tokenizer, pass_time_ms=math.inf)
    try:
        assert engine.batch_invariant and whole.batch_invariant
        prompts = questions(1, 6, document_words=120)
        params = SamplingParams(temperature=0, max_tokens=6)
        with engine.hold():
            futures = engine._enqueue(engine._intake.prepare_many(prompts, params, None), capture_logits=True)

            def new_budget() -> None:
                engine._scheduler.pass_time_s = budgets.choice([0.005, 0.02, 0.05, 0.3])

            passes = step_until_done(engine, futures, new_budget)
        packed = [(f.result()[0].token_ids, f.result()[1]) for f in futures]
        assert passes > len(prompts) and engine.stats()["prefix_hit_tokens"] > 0
        solo = alone(whole, prompts, [params] * len(prompts))
        assert [p[0] for p in packed] == [s[0] for s in solo]
        assert all(torch.equal(p[1], s[1]) for p, s in zip(packed, solo))
    finally:
        engine.close()
        whole.close()


def test_a_pass_that_can_pause_takes_prompts_under_way_whole_and_a_question_only_if_it_fits() -> None:
    """`schedule(whole=True)`: a prompt already under way runs whole, and a question waiting
    beside it joins only where the pass is predicted within the target with it: otherwise it
    starts between the pass's slices (tests/test_paused_pass.py), not after a pass of many targets."""
    s = scheduler(budget_ms=100.0)
    long_one = request(0, 3000)
    s.add([long_one])
    assert run(s) == {long_one: 200}  # a timed pass: ALONE_FACTOR targets of it
    short = request(1, 30)
    s.add([short])
    chunks = s.schedule(whole=True)
    assert {c.request: c.num_tokens for c in chunks} == {long_one: 2800}
    s.update(chunks)
    fits = request(2, 30)
    s.add([fits])
    assert {c.request for c in s.schedule(whole=True)} == {short, fits}  # nothing under way: both fit the target
