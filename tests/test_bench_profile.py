"""benchmarks/profile_parts.py: a profile's kernels are summed into the named parts of a step,
forward and backward apart, through the compiled module's name stacks (a jax 0.11 GPU trace names
only the HLO instruction), and a CPU trace gives the same table from its thunk events."""

import jax
import jax.numpy as jnp
import profile_parts


def _step():
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

    return jax.jit(step)


def test_compiled_instructions_map_to_the_named_parts_of_the_step():
    text = _step().lower(jnp.ones((4, 4)), jnp.ones((3, 4, 4))).compile().as_text()
    scopes = profile_parts.hlo_scopes(text)
    parts = {profile_parts.part_of(s) for s in scopes.values()}
    assert {("char CNN", "forward"), ("LSTM", "forward"), ("LSTM", "backward"), ("softmax", "forward")} <= parts
    assert ("optimizer", "forward") in parts, parts
    # Nearly every fusion the compiler made has a name stack, its own or that of the ops it calls
    # (broadcasts of constants have none).
    fusions = [
        line.split("=")[0].split()[-1].lstrip("%") for line in text.splitlines() if " fusion(" in line and "=" in line
    ]
    assert len(fusions) > 10 and sum(f in scopes for f in fusions) >= 0.8 * len(fusions)
    part_of = profile_parts.part_of
    assert part_of("jit(step)/transpose(jvp(lstm))/while/body/dot_general") == ("LSTM", "backward")
    assert part_of("jit(step)/jvp(softmax_rows)/gather") == ("softmax", "forward")
    # The dropout masks' threefry draws sit inside the LSTM's scope but are counted apart.
    assert part_of("jit(per_device)/jvp(lstm)/vmap(jit(_bernoulli))/jit(_uniform)") == ("dropout RNG", "forward")
    assert part_of("") == ("other", "forward")


def test_a_cpu_trace_is_summed_into_parts_from_its_innermost_events(tmp_path):
    step = _step()
    w, x = jnp.ones((64, 64)) * 0.01, jnp.ones((8, 64, 64))
    compiled = step.lower(w, x).compile()
    step(w, x).block_until_ready()
    jax.profiler.start_trace(str(tmp_path))
    for _ in range(2):
        step(w, x).block_until_ready()
    jax.profiler.stop_trace()
    ks = profile_parts.kernels(str(tmp_path), profile_parts.module_name(compiled.as_text()))
    assert ks and all(k.ns >= 0 for k in ks)
    # Innermost only: no kept event holds another on its thread (a while thunk holds its body's).
    spans = sorted((k.start_ns, k.start_ns + k.ns) for k in ks)
    busy = profile_parts.busy_ns(ks)
    assert 0 < busy <= spans[-1][1] - spans[0][0] + 1 and busy <= sum(k.ns for k in ks) + 1
    lines = profile_parts.table(ks, compiled.as_text(), 2, wall_s=1.0)
    lstm = next(line for line in lines if line.startswith("LSTM"))
    forward, backward = (float(v) for v in lstm.split()[1:3])
    assert forward > 0 and backward > 0, lines
    assert any(line.startswith("idle") for line in lines)
    # Negative control: another module's name finds none of these kernels.
    assert profile_parts.kernels(str(tmp_path), "jit_some_other_program") == []
