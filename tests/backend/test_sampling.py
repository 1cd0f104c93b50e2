"""sample(): greedy ties, per-row temperature / top-k / top-p, per-request generators."""

from __future__ import annotations

import pytest
import torch

from backend.sampling import (
    NO_TOKEN,
    Penalties,
    SamplingBatch,
    _filter_top_k_top_p,
    process_logits,
    sample,
)


def generator(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def batch(
    rows: int,
    temperature: float | list[float] = 1.0,
    top_p: float | list[float] = 1.0,
    top_k: int | list[int] = 0,
    generators: list[torch.Generator] | None = None,
    min_p: float | None = None,
) -> SamplingBatch:
    def column(value: float | list[float], dtype: torch.dtype) -> torch.Tensor:
        values = value if isinstance(value, list) else [value] * rows
        return torch.tensor(values, dtype=dtype)

    return SamplingBatch(
        temperature=column(temperature, torch.float32),
        top_p=column(top_p, torch.float32),
        top_k=column(top_k, torch.int64),
        generators=generators or [generator(row) for row in range(rows)],
        min_p=None if min_p is None else column(min_p, torch.float32),
    )


def draws(logits: torch.Tensor, n: int, seed: int = 0, **params: float | int) -> torch.Tensor:
    """`n` samples of one distribution: `n` rows of the same logits, one shared generator."""
    rows = logits.expand(n, -1).clone()
    return sample(rows, batch(n, generators=[generator(seed)] * n, **params))


LOGITS = torch.tensor([1.0, 2.5, 0.3, 2.0, -1.0, 0.9, 1.7, -0.2])


def test_greedy_is_argmax_with_ties_to_the_lower_id() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0], [-2.0, -1.0, -3.0, -1.0]])
    assert sample(logits, batch(3, temperature=0.0)).tolist() == [1, 0, 1]
    # The same when other rows of the batch sample.
    mixed = batch(4, temperature=[0.0, 0.0, 0.0, 1.0])
    assert sample(torch.cat([logits, logits[:1]]), mixed)[:3].tolist() == [1, 0, 1]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_that_bans_every_id_samples_no_token(temperature: float) -> None:
    """Its argmax would be id 0 (an EOS on many models, whose text would end as if complete)."""
    rows = batch(2, temperature=temperature)
    rows.bias = torch.zeros(2, len(LOGITS))
    rows.bias[0] = float("-inf")  # every id: say the allowed ids are stop ids, under min_tokens
    rows.bias[1, :3] = float("-inf")
    tokens = sample(LOGITS.expand(2, -1).clone(), rows).tolist()
    assert tokens[0] == NO_TOKEN
    assert tokens[1] >= 3 and (temperature > 0 or tokens[1] == 3)


def test_logits_are_not_modified() -> None:
    logits = LOGITS.expand(4, -1).clone()
    before = logits.clone()
    sample(logits, batch(4, temperature=[0.0, 0.7, 1.0, 2.0], top_k=[0, 2, 3, 0], top_p=0.5))
    assert torch.equal(logits, before)


def test_top_k_one_and_tiny_top_p_always_give_the_argmax() -> None:
    argmax = int(LOGITS.argmax())
    for params in ({"top_k": 1}, {"top_p": 1e-6}, {"top_k": 1, "temperature": 5.0}):
        assert (draws(LOGITS, 500, **params) == argmax).all(), params


def test_sampled_ids_stay_inside_the_top_k_set() -> None:
    allowed = set(LOGITS.topk(3).indices.tolist())
    seen = set(draws(LOGITS, 3000, top_k=3, temperature=2.0).tolist())
    assert seen == allowed  # inside, and each of them drawn at a high temperature


def test_sampled_ids_stay_inside_the_nucleus() -> None:
    # Sorted probs 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps the first two (mass before < 0.7).
    logits = torch.tensor([0.15, 0.5, 0.05, 0.3]).log()
    result = draws(logits, 4000, top_p=0.7)
    assert set(result.tolist()) == {1, 3}
    share = (result == 1).float().mean().item()
    assert abs(share - 0.5 / 0.8) < 0.03


def test_top_p_applies_to_the_top_k_renormalised_distribution() -> None:
    # top_k 3 keeps 0.5, 0.3, 0.15 -> 0.526, 0.316, 0.158; top_p 0.8 keeps the first two.
    logits = torch.tensor([0.15, 0.5, 0.05, 0.3]).log()
    assert set(draws(logits, 3000, top_k=3, top_p=0.8).tolist()) == {1, 3}


def test_each_row_follows_its_own_parameters() -> None:
    n = 400
    logits = LOGITS.expand(4 * n, -1).clone()
    per_row = batch(
        4 * n,
        temperature=[0.0] * n + [1.0] * n + [1.0] * n + [3.0] * n,
        top_k=[0] * n + [1] * n + [2] * n + [0] * n,
        generators=[generator(7)] * (4 * n),
    )
    result = sample(logits, per_row).view(4, n)
    argmax, second = LOGITS.topk(2).indices.tolist()
    assert (result[0] == argmax).all()  # greedy
    assert (result[1] == argmax).all()  # top_k 1
    assert set(result[2].tolist()) == {argmax, second}  # top_k 2
    assert len(set(result[3].tolist())) == len(LOGITS)  # hot and unfiltered: everything


def test_a_seeded_row_draws_the_same_whatever_else_is_in_the_batch() -> None:
    steps = 20
    alone_gen = generator(1234)
    alone = [sample(LOGITS[None], batch(1, generators=[alone_gen])).item() for _ in range(steps)]
    batched_gen = generator(1234)
    batched = []
    for step in range(steps):
        others = torch.randn(3, len(LOGITS), generator=generator(100 + step))
        logits = torch.cat([others[:2], LOGITS[None], others[2:]])
        params = batch(
            4,
            temperature=[0.0, 2.0, 1.0, 0.5],
            top_k=[0, 3, 0, 1],
            top_p=[1.0, 0.9, 1.0, 0.2],
            generators=[generator(step), generator(step + 1), batched_gen, generator(9)],
        )
        batched.append(sample(logits, params)[2].item())
    assert batched == alone
    assert len(set(alone)) > 1  # it did sample


def test_an_unfiltered_row_beside_a_filtered_one_keeps_every_id() -> None:
    """top_p 1 and top_k 0 filter nothing, also when a batch-mate's top-k makes the batch
    filter: the row's draw must not depend on its neighbours (vLLM sums the tail, not the
    head, for this)."""
    logits = torch.randn(2, 32000, generator=generator(3)) * 10  # peaked, as at T = 0.5
    params = batch(2, temperature=1.0, top_k=[0, 5], top_p=[1.0, 1.0])
    filtered = logits.clone()
    _filter_top_k_top_p(filtered, params.top_k, params.top_p)
    assert torch.equal(filtered[0], logits[0])
    assert torch.isfinite(filtered[1]).sum().item() == 5
    alone = logits[:1].clone()
    assert torch.equal(
        sample(alone, batch(1, generators=[generator(11)])),
        sample(logits, batch(2, top_k=[0, 5], generators=[generator(11), generator(12)]))[:1],
    )


def test_top_k_keeps_the_ids_tied_with_the_kth_as_vllm() -> None:
    logits = torch.tensor([[2.0, 2.0, 1.0, 0.0], [3.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    filtered = logits.clone()
    top_k = torch.tensor([1, 2, 9])  # 9 > the vocabulary: everything
    _filter_top_k_top_p(filtered, top_k, torch.ones(3))
    assert torch.isfinite(filtered).tolist() == [
        [True, True, False, False],
        [True, True, True, False],
        [True, True, True, True],
    ]


def test_frequencies_at_temperature_one_match_the_softmax() -> None:
    n = 40000
    probs = LOGITS.double().softmax(-1)
    counts = torch.bincount(draws(LOGITS, n, seed=3), minlength=len(LOGITS)).double() / n
    # 4.5 standard deviations of a binomial share with n draws.
    tolerance = 4.5 * (probs * (1 - probs) / n).sqrt()
    assert ((counts - probs).abs() <= tolerance).all(), (counts, probs)


def test_temperature_scales_the_logits() -> None:
    n = 40000
    probs = (LOGITS.double() / 2.0).softmax(-1)
    counts = torch.bincount(draws(LOGITS, n, seed=4, temperature=2.0), minlength=8).double() / n
    tolerance = 4.5 * (probs * (1 - probs) / n).sqrt()
    assert ((counts - probs).abs() <= tolerance).all(), (counts, probs)


@pytest.mark.parametrize("vocab", [200, 256])  # xgrammar's kernel; the word path (V % 32 == 0)
def test_a_grammar_mask_gives_the_tokens_of_the_masked_logits(vocab: int) -> None:
    """Constrained rows sample only allowed ids, exactly as from logits masked beforehand (the
    same draws), with and without top-k; free rows are untouched."""
    from backend.grammar import RowMask

    rows = 6
    torch.manual_seed(0)
    for trial in range(20):
        logits = torch.randn(rows, vocab) * 3
        bits = torch.randint(-(2**31), 2**31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32)
        bits[:, 0] |= 1  # id 0 allowed: no row is left without a choice
        constrained = [0, 2, 3, 5]
        params = {
            "temperature": [0.0, 0.0, 0.8, 1.0, 1.3, 0.0],
            "top_k": [0] * rows if trial % 2 else [0, 0, 5, 0, 0, 0],  # top-k: mask first
        }
        bits[0, 1:3] = 0  # whole words refused and allowed, as grammars mostly have
        bits[2, 2:4] = -1
        mask = RowMask(bits, constrained, vocab)
        expected_logits = logits.clone()
        for row in constrained:  # by hand, id by id
            for token in range(vocab):
                if not (int(bits[row, token // 32]) >> (token % 32)) & 1:
                    expected_logits[row, token] = float("-inf")
        expected = sample(expected_logits, batch(rows, generators=None, **params))
        masked = batch(rows, generators=None, **params)
        masked.grammar_mask = mask
        tokens = sample(logits, masked)
        assert tokens.tolist() == expected.tolist(), trial
        for row in constrained:
            token = int(tokens[row])
            assert (int(bits[row, token // 32]) >> (token % 32)) & 1


def test_a_grammar_mask_reaches_xgrammar_on_the_logits_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Off CPU the mask goes through xgrammar's kernel, which refuses a bitmask on another
    device than the logits: the host bitmask is copied over first (the meta device stands in
    for CUDA here, which this machine lacks)."""
    import xgrammar

    from backend.grammar import RowMask

    seen = []

    def apply(logits: torch.Tensor, bitmask: torch.Tensor, **kwargs: object) -> None:
        seen.append((logits.device, bitmask.device, bitmask.shape, kwargs))

    monkeypatch.setattr(xgrammar, "apply_token_bitmask_inplace", apply)
    bits = torch.zeros(4, 8, dtype=torch.int32)
    RowMask(bits, [1, 2], 256).apply(torch.empty(3, 256, device="meta"))
    meta = torch.device("meta")
    assert seen == [(meta, meta, (3, 8), {"vocab_size": 256, "indices": [1, 2]})]


def test_min_p_keeps_ids_at_least_that_share_of_the_most_probable() -> None:
    """Probs 0.5, 0.3, 0.15, 0.05: min_p 0.5 keeps 0.5 and 0.3 (>= 0.25), renormalised to
    0.625 / 0.375; at temperature 2 the probs flatten and 0.15 passes too."""
    logits = torch.tensor([0.15, 0.5, 0.05, 0.3]).log()
    n = 40000
    counts = torch.bincount(draws(logits, n, seed=5, min_p=0.5), minlength=4).double() / n
    probs = torch.tensor([0.0, 0.625, 0.0, 0.375], dtype=torch.float64)
    tolerance = 4.5 * (probs * (1 - probs) / n).sqrt()
    assert ((counts - probs).abs() <= tolerance).all(), counts
    hot = draws(logits, 4000, seed=6, min_p=0.5, temperature=2.0)
    assert set(hot.tolist()) == {0, 1, 3}  # sqrt(0.15 / 0.5) = 0.55 >= 0.5; sqrt(0.1) < 0.5


@pytest.mark.parametrize("temperature", [1e-6, 1e-39, 1e-45])
def test_a_temperature_below_vllms_epsilon_is_greedy(temperature: float) -> None:
    """Dividing by it overflowed float32 to inf, and the NaN softmax gave id 0."""
    rows = draws(LOGITS, 200, temperature=temperature)
    assert (rows == int(LOGITS.argmax())).all()


def penalised(
    repetition: float, seen: list[int], bias: dict[int, float], rows: int = 1
) -> SamplingBatch:
    """`rows` rows of LOGITS' vocabulary with a repetition penalty on `seen` and `bias`."""
    params = batch(rows, temperature=1.0)
    vocab = len(LOGITS)
    mask = torch.zeros(rows, vocab, dtype=torch.bool)
    mask[:, seen] = True
    params.penalties = Penalties(
        presence=torch.zeros(rows),
        frequency=torch.zeros(rows),
        repetition=torch.full((rows,), repetition),
        seen=mask,
        output_counts=torch.zeros(rows, vocab, dtype=torch.int64),
    )
    params.bias = torch.zeros(rows, vocab)
    for token, value in bias.items():
        params.bias[:, token] = value
    return params


def test_logit_bias_comes_before_the_repetition_penalty_as_in_vllm() -> None:
    """Id 0 (logit 1.0, seen, bias +3.5, penalty 2) against id 1 (2.5): vLLM's order gives
    (1 + 3.5) / 2 = 2.25 and id 1 wins; the bias after the penalty gave 1 / 2 + 3.5 = 4.0."""
    processed = process_logits(LOGITS[None], penalised(2.0, seen=[0], bias={0: 3.5}))
    assert processed[0, 0].item() == pytest.approx(2.25)
    greedy = penalised(2.0, seen=[0], bias={0: 3.5})
    greedy.temperature = torch.zeros(1)
    assert sample(LOGITS[None], greedy).item() == 1


def test_a_tiny_repetition_penalty_gives_the_seen_id_not_a_nan_row() -> None:
    """A seen positive logit (id 5's 0.9) over 1e-39 overflows float32; it is the id drawn."""
    rows = penalised(1e-39, seen=[5], bias={}, rows=50)
    assert (sample(LOGITS.expand(50, -1).clone(), rows) == 5).all()
