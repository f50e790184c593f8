"""benchmarks/bench_variants.py: the parts of a step a GPU profile is summarised into come from
the compiled module's name stacks (a jax 0.11 GPU trace names only the HLO instruction)."""

import bench_variants
import jax
import jax.numpy as jnp


def test_compiled_instructions_map_to_the_named_parts_of_the_step():
    def loss(w, x):
        with jax.named_scope("char_cnn"):
            x = jnp.tanh(x @ w)
        with jax.named_scope("lstm"):
            h, _ = jax.lax.scan(lambda h, xt: (jnp.tanh(h @ w + xt), None), jnp.zeros(x.shape[1:]), x)
        with jax.named_scope("softmax"):
            return jax.nn.logsumexp(h @ w)

    def step(w, x):
        g = jax.grad(loss)(w, x)
        with jax.named_scope("optimizer"):
            return w - 0.1 * g

    text = jax.jit(step).lower(jnp.ones((4, 4)), jnp.ones((3, 4, 4))).compile().as_text()
    scopes = bench_variants.hlo_scopes(text)
    parts = {bench_variants.part_of(s) for s in scopes.values()}
    assert {"char_cnn", "lstm", "lstm (backward)", "softmax", "optimizer"} <= parts, parts
    # Nearly every fusion the compiler made has a name stack, its own or that of the ops it calls
    # (broadcasts of constants have none).
    fusions = [
        line.split("=")[0].split()[-1].lstrip("%") for line in text.splitlines() if " fusion(" in line and "=" in line
    ]
    assert len(fusions) > 10 and sum(f in scopes for f in fusions) >= 0.8 * len(fusions)
    assert bench_variants.part_of("jit(step)/transpose(jvp(lstm))/while/body/dot_general") == "lstm (backward)"
    assert bench_variants.part_of("jit(step)/jvp(softmax_rows)/gather") == "softmax_rows"
    assert bench_variants.part_of("") == "other"
