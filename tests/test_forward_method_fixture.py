"""traces/cpu/vae_encode_registered: tests/test_outside_unit_call.py's VAE-shaped model (encode() returns a posterior
built from _encode()'s moments; the loop calls encode(), then decode(); a KL term), the whole model one unit, with the
outer method registered, register_fsdp_forward_method(model, 'encode'), AdamW, 2 gloo ranks, profile=False. encode()
returns no tensor for FSDP2's backward hooks: the post-backward never runs, the gradients stay on the gathered
parameters and nothing trains; decode() runs outside the registered method, timed as outside the model.

Read as recorded: the diagnosis says why nothing trains (not "what clears the gradients"), memory.grads_kept does not
read the unreduced gradients as kept ones, and the records' "input-bound" verdict says what its input share holds and
is no warning of its own."""

from pathlib import Path

from fsdp_doctor import build_report, load_run

RUN = Path(__file__).resolve().parents[1] / "traces" / "cpu" / "vae_encode_registered"


def test_a_registered_method_without_tensors_is_diagnosed_as_recorded():
    report = build_report(load_run(RUN))
    found = {f.code: f for f in report.findings}
    status = {s.code: s for s in report.rules}
    f = found["optim.no_gradients"]
    assert f.severity == "critical" and f.evidence["unsharded_grads_held_bytes"] > 0, f.evidence
    text = f.recommendation.text
    assert "FSDP2's post-backward, which reduce-scatters them into the sharded parameters the optimizer steps, " \
           "never ran" in text, text
    assert "encode() of the model ran as forward (register_fsdp_forward_method)" in text, text
    assert "Look for what clears or detaches" not in text, text
    # the unreduced gradients are optim.no_gradients' (they read "zeroed in place instead of freed")
    assert "memory.grads_kept" not in found and status["memory.grads_kept"].status == "quiet"
    # input-bound from the records, where decode() lies outside the registered encode(): said, and no warning
    v = report.verdict.job
    assert v.bound == "input" and v.groups_pct["input"] >= 50, v
    assert "the model runs through encode(), registered as its forward: its other methods the loop calls run " \
           "outside it" in v.summary, v.summary
    assert "verdict.severe" not in found, found["verdict.severe"].title
    assert "registered forward method(s) (encode())" in status["verdict.severe"].reason, status["verdict.severe"]
