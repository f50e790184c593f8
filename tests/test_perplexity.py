"""The held-out evaluation's memory does not grow with the vocabulary (``elmo_jax.training.evaluate``).

bilm-tf's 128 rows x 20 steps at the released 793,471-word vocabulary: the compiled evaluation
step's temporary memory (``memory_analysis``, compile only: nothing is allocated) must stay within
64 MiB of the same step at 10,000 words. The control, the textbook formula that materialises the
``[positions, V]`` logits, needs gigabytes more.
"""

from eval_memory import dense_temp, eval_step_temp

from elmo_jax import PRESETS

MiB = 2**20


def test_evaluation_memory_does_not_grow_with_the_vocabulary():
    model = PRESETS["tiny"]
    small, released = eval_step_temp(model, 10_000), eval_step_temp(model, 793_471)
    assert released - small <= 64 * MiB, (small / MiB, released / MiB)
    control = dense_temp(model, 793_471) - dense_temp(model, 10_000)
    assert control > 4096 * MiB, control / MiB  # ~30 GiB of logits: the test can tell
