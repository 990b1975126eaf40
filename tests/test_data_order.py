"""StepSampler: the global batch of a step as a pure function of (seed, step)."""

from megadare.trainer.data_order import StepSampler


def test_a_batch_spanning_many_epochs_is_the_same_when_asked_again():
    # 2 prompts, 16 per step (a newcomer's first RL file): one batch covers 8 epochs, more than the cache holds;
    # asking for step 0 again evicted the epoch it had just built (KeyError: 0 in the RL run's first rollout)
    sampler = StepSampler(2, 16, seed=1234)
    first = sampler.batch(0)
    assert sampler.batch(0) == first
    assert sorted(first) == [0] * 8 + [1] * 8
    fresh = StepSampler(2, 16, seed=1234)
    assert [fresh.batch(s) for s in (3, 0, 3)] == [sampler.batch(3), first, sampler.batch(3)]
