"""The scenario matrix (tests/scenario_matrix.py): every planted problem on its model trees is found at its
severity, every tuned baseline has no warning, and every fix the diagnosis prints, pasted where it says, is
rechecked in a fresh run: the finding gone (or its figure improved by at least half the prediction), no new
warning, the peak within 10% of the predicted one. Step-time predictions are recorded (benchmarks/scenarios.py
prints them beside the measured step), not asserted on this noisy host."""

from __future__ import annotations

import re

import pytest

import scenario_matrix as M

pytestmark = pytest.mark.slow

PLANTED = [r.name for r in M.ROWS if r.code]
BASELINES = [r.name for r in M.ROWS if r.code is None]
APPLIED = [pytest.param(r.name, marks=pytest.mark.xfail(reason=M.KNOWN_WRONG[r.name], strict=True))
           if r.name in M.KNOWN_WRONG else r.name for r in M.ROWS if r.code and r.apply]


def _ran(o: M.Outcome) -> M.Outcome:
    assert not o.error, o.error
    return o


@pytest.mark.parametrize("row", PLANTED)
def test_planted_problem_is_found(matrix, row):
    o, r = _ran(matrix[row]), M.BY_NAME[row]
    assert o.finding is not None, (f"{row}: expected {r.code} at {r.min_severity}+, got "
                                   f"{[(f.code, f.severity) for f in o.findings]}; "
                                   + next((f"{s.status}: {s.reason}" for s in o.report.rules if s.code == r.code), ""))
    assert o.finding.evidence and o.finding.recommendation.text


@pytest.mark.parametrize("row", [r.name for r in M.ROWS if r.code == "prefetch.exposed_allgather"])
def test_exposed_allgather_planted_well_above_its_threshold(matrix, row):
    """The planted all-gathers set the step (M.GATHER_BOUND: micro-batches of 16 tokens), so a loaded host cannot
    bring the finding down to its threshold: the waits are at least twice the share of the step it fires from. The
    reference shape measured 14-29% on this host, quiet or loaded, against 15%, and failed its row under load."""
    from fsdp_doctor.diagnose.rules.prefetch import EXPOSED_AG_INFO_SHARE_CPU

    o = _ran(matrix[row])
    assert o.finding is not None, next(f"{s.status}: {s.reason}" for s in o.report.rules if s.code == o.row.code)
    assert o.finding.evidence["exposed_share_pct"] >= 2 * 100 * EXPOSED_AG_INFO_SHARE_CPU, o.finding.evidence


@pytest.mark.parametrize("row", [r.name for r in M.ROWS if r.code and not r.apply])
def test_advice_in_words_prints_no_code(matrix, row):
    """Where the lever is the user's code the doctor does not see (the data pipeline, what one rank does, the batch
    size), the finding says what to look for in words: no template with placeholders to paste."""
    o = _ran(matrix[row])
    assert o.finding is not None and o.finding.recommendation.text
    assert o.finding.recommendation.code == "", o.finding.recommendation.code


@pytest.mark.parametrize("row", BASELINES)
def test_tuned_baseline_has_no_warning(matrix, row):
    o = _ran(matrix[row])
    assert M.warnings_of(o.findings) - M.NOISE == set(), [(f.code, f.severity, f.title) for f in o.findings]


@pytest.mark.parametrize("row", APPLIED)
def test_fix_applied_and_rechecked(matrix, row):
    o = _ran(matrix[row])
    assert o.finding is not None, row
    assert o.fix, f"{row}: {o.finding.code} prints no code"
    assert o.fix["where"] in ("unsharded", "before_shard", "sharded", "prepared", "parallelized", "around", "optimizer",
                              "loop", "backward", "after_backward", "evaluation")
    assert not o.after_error, (o.after_error, o.fix["code"])
    rc = o.recheck()
    assert not rc["new_warnings"], (rc, o.fix["code"])
    assert not M.changed_options(o), (M.changed_options(o), o.fix["code"])  # the user's other options kept
    assert not M.undone(o), (M.undone(o), o.fix["code"])  # no rule asks for what the fix changed back
    if o.row.gpu_gain:  # its gain is overlap a GPU has (the rule predicts none on gloo): rechecked there
        return
    assert rc["gone"] or rc["improved"], (rc, o.fix["code"])
    if rc["peak_ok"] is not None:
        assert rc["peak_ok"], (rc["peak_measured"], rc["peak_predicted"], o.fix["code"])


@pytest.mark.rows(*[r.name for r in M.ROWS])
def test_every_quiet_rule_says_why_on_every_row(matrix):
    """Every rule that stayed quiet on a row's run says why (its figure against its threshold), on every tree."""
    from fsdp_doctor.diagnose import NO_REASON

    bare = {(name, s.code) for name, o in matrix.items() if o.report is not None
            for s in o.report.rules if s.status == "quiet" and s.reason == NO_REASON}
    assert not bare, sorted(bare)


@pytest.mark.rows(*[r.name for r in M.ROWS])
def test_no_row_reads_as_an_unknown_torch_or_prints_a_no_op(matrix):
    """On the torch these rows run (a supported one), no run says a field of FSDP's could not be read: several FSDP
    roots (fully_shard never applied to the model: the no_root rows) each run their lazy init at their first forward,
    after the doctor's first read, which had read the not-yet-initialised comm state as an unknown torch
    ("comm_buffers unknown", exit 3). And no fix is a no-op: with every unit its own root, explicit prefetch listed
    no unit ("forward_order = []")."""
    unknown = {name: o.report.problems for name, o in matrix.items() if o.report is not None
               and any("cannot read" in p or "not recognised" in p for p in o.report.problems)}
    assert not unknown, unknown
    no_ops = {(name, f.code) for name, o in matrix.items() if o.report is not None for f in o.findings
              if re.search(r"^\w+ = \[\]$", f.recommendation.code, re.M) and "+=" not in f.recommendation.code}
    assert not no_ops, sorted(no_ops)


@pytest.mark.parametrize("row", [r.name for r in M.ROWS if r.code == "wrap.root_not_sharded" and r.profile])
def test_several_roots_are_not_gradient_accumulation(matrix, row):
    """Every block its own FSDP root: FSDP names no root in its labels, so the trace counts the roots' reduce-scatters
    as one "(root)" unit's, several per step, as one root's over micro-batches would be. The records say one forward
    pass per unit per step: accum.sync_every_micro_batch stays quiet and says why (it warned, with a fix that raised
    AttributeError on the unsharded root)."""
    o = _ran(matrix[row])
    assert "accum.sync_every_micro_batch" not in {f.code for f in o.findings}
    (s,) = [s for s in o.report.rules if s.code == "accum.sync_every_micro_batch"]
    assert s.status == "quiet" and "1 forward pass per unit per step" in s.reason, (s.status, s.reason)
    rs = [x for x in o.report.overlap.per_unit if x.collective == "reduce_scatter"]
    assert {x.unit for x in rs} == {"(root)"} and all(x.count_per_step > 1.5 for x in rs), rs  # what it read


# ------------------------------------------------------------------------------------------------ fine-tuning block
@pytest.mark.parametrize("row", ["lora_tuned", "qwen2_tail_tuned", "gpt2_tuned", "bert_tuned"])
def test_fine_tuning_figures_match_the_model(matrix, row):
    """A frozen base: every figure a fine-tuner checks, against the model built here (tests/clients.py FINETUNE;
    GPT-2, whose Conv1D weights are (in, out), and BERT, both with a tied embedding, train every parameter):
    parameters, each unit's trainable bytes (sharded with FSDP's padding, unsharded), AdamW's state at the peak (two
    fp32 tensors per trainable shard element and a step per trainable tensor; nothing for frozen ones), no gradient
    shard beyond the trainable ones, each unit's reduce-scatter message its trainable gradients (none for a frozen
    unit), and the counted FLOPs."""
    import math

    from clients import BUILD

    o = _ran(matrix[row])
    rep, model = o.report, BUILD[M.BY_NAME[row].tree]()
    world = 2
    mods = {m: u.name for u in rep.units for m in u.modules if m}

    def unit_of(fqn: str) -> str:
        own = [m for m in mods if fqn.startswith(m + ".")]
        return mods[max(own, key=len)] if own else ""

    want: dict[str, list[int]] = {u.name: [0, 0, 0] for u in rep.units}  # trainable: sharded, unsharded; tensors
    for fqn, p in model.named_parameters():
        if p.requires_grad:
            w = want[unit_of(fqn)]
            w[0] += math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0]) * 4
            w[1] += p.numel() * 4
            w[2] += 1
    assert rep.run.model_param_count == sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert rep.run.model_trainable_param_count == trainable
    from fsdp_doctor.present.fmt import run_facts as header_facts

    share = f"{100 * trainable / rep.run.model_param_count:.2g}% trainable"  # the header says how much is trained
    assert any(share in f for f in header_facts(rep.run)) == (trainable < rep.run.model_param_count), header_facts(
        rep.run)
    assert {u.name: [u.trainable_sharded_bytes, u.trainable_unsharded_bytes] for u in rep.units} == {
        k: v[:2] for k, v in want.items()}
    for r, pm in rep.memory.per_rank.items():
        assert pm.peak_at.step >= 1  # after an optimizer step: its state exists
        bd = pm.peak_breakdown
        assert bd["optimizer_state"] == sum(2 * w[0] + 4 * w[2] for w in want.values()), r
        assert bd["sharded_grads"] <= sum(w[0] for w in want.values()), r
        # when the optimizer step starts: every trainable gradient shard, nothing for the frozen base
        opt = next(x for x in pm.timeline if x.get("phase") == "optimizer_start")
        assert opt["sharded_grads"] == sum(w[0] for w in want.values()), r
        assert opt["sharded_params"] == sum(math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0]) * 4
                                            for p in model.parameters()), r
    rs = {(x.unit, x.bytes_per_call) for x in rep.overlap.per_unit if x.collective == "reduce_scatter"}
    label = {u.name: u.name or "(root)" for u in rep.units}
    assert rs == {(label[k], float(v[1])) for k, v in want.items() if v[1]}
    for r, t in rep.throughput.per_rank.items():
        assert t.flops_source == "counted" and t.flops_per_step == t.hardware_flops_per_step  # no recompute


def _backward_gathers(rep) -> set:
    """(rank, unit) of every backward all-gather in a report's trace."""
    return {(r.rank, r.unit) for r in rep.overlap.per_unit if r.collective == "all_gather" and r.phase == "backward"}


@pytest.mark.rows("qwen2_tail_frozen_gather")
def test_frozen_unit_gather_gone_with_losses_unchanged(matrix):
    """prefetch.frozen_gathered's fix on the real run: the trace's backward all-gather of the frozen layers.1 (which
    layers.2's default prefetch issued, its own backward never running) is gone on every rank, layers.2's own is
    still prefetched, the losses are bit-identical and the peak is not higher."""
    o = _ran(matrix["qwen2_tail_frozen_gather"])
    assert o.after is not None, o.after_error or o.rerun_note

    assert {(0, "model.layers.1"), (1, "model.layers.1")} <= _backward_gathers(o.report)
    assert _backward_gathers(o.after) == {(0, "model.layers.2"), (1, "model.layers.2")}
    assert o.result["losses"] == o.after_result["losses"]
    # where the fix acts, from layers.2's backward to the end of backward (the frozen layer's buffer held there, never
    # used), memory is lower: 1,509,372 -> 1,411,068 B in each of 4 reruns. Not the step's peak: after the fix it moves to the head's backward, whose temporaries
    # vary from run to run on this host (a fresh clone's make test read 1,590,012 B, in the loss, for 1,509,372 before;
    # other reruns 1,623,804 and 1,492,476 in the head's backward)
    before, after = _high_from(o.report, "model.layers.2"), _high_from(o.after, "model.layers.2")
    assert after < before, (after, before)


@pytest.mark.rows("clip_lit_frozen_gather")
def test_frozen_tower_run_first_gathered_by_the_other_tower_gone_with_losses_unchanged(matrix):
    """A CLIP's LiT (the vision tower frozen): its forward runs the vision tower first, so the first trainable unit
    in that order, the text embeddings, gathers the last vision layer in every backward by FSDP2's default prefetch
    (module order puts the text tower first: the rule read it and stayed quiet, a new-user trial). The fix gives the
    text embeddings a list of their own: the trace's backward all-gather of the vision layer gone on every rank, the
    losses bit-identical."""
    o = _ran(matrix["clip_lit_frozen_gather"])
    assert o.after is not None, o.after_error or o.rerun_note
    (f,) = [f for f in o.report.findings if f.code == "prefetch.frozen_gathered"]
    assert f.evidence["gathered_for_nothing"] == ["vision_model.encoder.layers.2 (130.75 KiB), prefetched by "
                                                  "text_model.embeddings's default (the previous unit in forward "
                                                  "order)"], f.evidence

    assert {(0, "vision_model.encoder.layers.2"), (1, "vision_model.encoder.layers.2")} <= _backward_gathers(o.report)
    assert not {u for _, u in _backward_gathers(o.after)} & {f"vision_model.encoder.layers.{i}" for i in range(3)}
    assert o.result["losses"] == o.after_result["losses"]


@pytest.mark.rows("lora_blocks_only")
def test_plan_for_a_frozen_root_gathers_its_new_leading_unit_for_nothing_never(matrix):
    """wrap.params_in_root on a LoRA model (its frozen embeddings, final norm and head left in the root): the plan makes
    the frozen embeddings a unit before the decoder layers, and the first layer, which trains, keeps FSDP2's default
    backward prefetch off with a list of its own; the rerun raises no prefetch.frozen_gathered at any severity (a
    new-user trial's peft Mixtral did, as a new note after the fix)."""
    o = _ran(matrix["lora_blocks_only"])
    assert o.after is not None, o.after_error or o.rerun_note
    assert "set_modules_to_backward_prefetch([unit])" in o.fix["code"], o.fix["code"]
    assert "prefetch.frozen_gathered" not in {f.code for f in o.after.findings}
    frozen = [u.name for u in o.after.units if not u.is_root and u.trainable_sharded_bytes == 0]
    assert any(n.endswith("embed_tokens") for n in frozen), frozen


@pytest.mark.rows("hf_llama_head_in_root", "hf_llama_head_in_root_long_batch", "hf_llama_tuned_long_batch",
                  "titan_blocks_only", "titan_blocks_only_2_ranks", "titan_tuned")
def test_root_modules_freeing_under_a_hundredth_of_the_peak_are_no_warning(matrix):
    """wrap.params_in_root where its plan, the rows' expert plan, frees under 1% of the peak: quiet, saying what the
    plan would free against the 1% it is worth from, and the expert plan's run measures it so. An HF Llama with its
    embedding and blocks units and its final norm and head in the root (19% of the parameters): at 2 x 32 tokens the
    plan frees the head's gathered copy where the peak is (2.6% of it; the row's rerun measured the prediction to the
    byte); at 8 x 64 tokens the peak is in the loss, where the head is gathered either way (the expert plan measured
    11,461,696 B, as the head in the root did). torchtitan's llama with bf16 parameters, blocks and root only: on 4
    ranks the root's gathered copy is twice its fp32 shard and the plan frees 1.9% of the peak (the row's rerun: as
    predicted); on 2 ranks the copy equals the shard and the plan frees nothing (1,160,532 B with it, 1,160,404 B
    without). A DiT's root (5.3% of the parameters) read a warning "peak 1.02 MiB -> 1.02 MiB": its plan freed 0.7%."""
    from fsdp_doctor.diagnose.rules.wrap import ROOT_PEAK_GAIN_MIN

    for fires in ("hf_llama_head_in_root", "titan_blocks_only"):
        f = next(f for f in _ran(matrix[fires]).findings if f.code == "wrap.params_in_root")
        assert -f.predicted.peak_bytes_delta > ROOT_PEAK_GAIN_MIN * f.predicted.peak_bytes_before, (fires, f.predicted)
    for quiet, plan, held, moved in (
            ("hf_llama_head_in_root_long_batch", "hf_llama_tuned_long_batch", 19, "model.model.norm, model.lm_head"),
            ("titan_blocks_only_2_ranks", "titan_tuned", 31, "model.tok_embeddings, model.norm, model.output")):
        o = _ran(matrix[quiet])
        s = next(s for s in o.report.rules if s.code == "wrap.params_in_root")
        assert s.status == "quiet", (quiet, s.status, s.reason)
        m = re.search(rf"(\d+)% of the parameters are in the root, but making {re.escape(moved)} units of their own "
                      r"would lower the peak by ([\d.]+ \w?i?B), ([\d.]+)% of the [\d.]+ MiB peak \(worth it from 1%",
                      s.reason)
        assert m and int(m.group(1)) == held and float(m.group(3)) < 100 * ROOT_PEAK_GAIN_MIN, (quiet, s.reason)
        peak, with_plan = _least_rank_peak(o), _least_rank_peak(_ran(matrix[plan]))
        assert peak - with_plan < ROOT_PEAK_GAIN_MIN * peak, (quiet, peak, with_plan)


def _least_rank_peak(o: M.Outcome) -> int:
    """A run's peak (bytes) as its least disturbed rank measured it. The matrix's ranks run one model on equal shards,
    but on gloo one rank now and then keeps a block's gathered copy alive into the loss (gloo's async work still
    holding the all-gather output: traces/cpu/titan_root_gloo_late_buffer), 73,984 B on titan's 1.16 MiB peak, 6%;
    CI's long tier read titan_blocks_only_2_ranks at 1,234,388 B so, against 1,160,532 B for its expert plan."""
    return min(m.peak_bytes for m in o.report.memory.per_rank.values())


def _high_from(report, unit: str) -> int:
    """The highest total (bytes) on the peak step's timeline from ``unit``'s backward_start to the end of that
    backward, over the ranks."""
    high = 0
    for pm in report.memory.per_rank.values():
        inside = False
        for r in pm.timeline:
            inside = inside or (r.get("unit") == unit and r.get("phase") == "backward_start")
            if inside:
                high = max(high, int(r.get("total") or 0))
            if inside and r.get("unit") is None and r.get("phase") == "backward_end":
                break
    return high


def test_a_missed_peak_runs_its_row_again_once(monkeypatch, tmp_path):
    """The runner's retry, with the launches stood in for: a row whose rerun's peak misses the prediction by more
    than its bound runs again, before and after; the second pair is the outcome, with the first's figures in
    ``retried``; a row within its bound runs once; a second miss stays a miss."""
    from fsdp_doctor.report_sections import Finding, MemorySection, Predicted, Recommendation, Report

    def report(peak, predicted=None):
        fs = [] if predicted is None else [Finding(
            code="wrap.params_in_root", severity="warning", title="t", evidence={},
            recommendation=Recommendation(text="t", code="pass", where="around"),
            predicted=Predicted(peak_bytes_before=peak, peak_bytes_after=predicted))]
        return Report(memory=MemorySection(peak_bytes=peak), findings=fs)

    # (row, attempt) -> (before's peak, its prediction, the rerun's peak): "late" is 145 KiB high the first time
    figures = {("late", 0): (1_854_716, 1_723_516, 1_509_372), ("late", 1): (1_706_236, 1_575_036, 1_509_372),
               ("held", 0): (1_706_236, 1_575_036, 1_509_372),
               ("wrong", 0): (1_706_236, 1_000_000, 1_509_372), ("wrong", 1): (1_706_236, 1_000_000, 1_509_372)}
    launches = []

    def launch_rows(rows, spec, tmp, tag, device="cpu"):
        launches.append((tag, sorted(r.name for r in rows)))
        return {r.name: {"capacity_bytes": None} for r in rows}

    def diagnosis(path):
        name, again = path.name.replace("_fixed", ""), path.name.count("_again")
        before, predicted, after = figures[(name.replace("_again", ""), again)]
        return None, report(after) if path.name.endswith("_fixed") else report(before, predicted)

    monkeypatch.setattr(M, "launch_rows", launch_rows)
    monkeypatch.setattr(M, "diagnosis", diagnosis)
    rows = [M.Row(n, "gpt", "wrap.params_in_root") for n in ("late", "held", "wrong")]
    out = M.run_matrix(tmp_path, rows)
    assert launches == [("before", ["held", "late", "wrong"]), ("after", ["held", "late", "wrong"]),
                        ("before_again", ["late", "wrong"]), ("after_again", ["late", "wrong"])]
    assert out["late"].recheck()["peak_ok"] and out["late"].recheck()["peak_predicted"] == 1_575_036
    assert out["late"].retried == "peak 1509372 B measured against 1723516 B predicted the first time"
    assert out["held"].recheck()["peak_ok"] and not out["held"].retried
    assert out["wrong"].recheck()["peak_ok"] is False and out["wrong"].retried
    # on a GPU (NCCL, live allocator figures) a miss is not run again
    launches.clear()
    assert M.run_matrix(tmp_path, rows, device="cuda")["late"].recheck()["peak_ok"] is False
    assert [t for t, _ in launches] == ["before", "after"]


@pytest.mark.parametrize("row", [r.name for r in M.ROWS if r.code == "accum.sync_every_micro_batch" and not r.gpu])
def test_accumulation_without_sync_peak_frees_the_sharded_gradients(matrix, row):
    """Without gradient sync until the last micro-batch, FSDP2 holds every unit's unsharded gradients and no sharded
    ones: the prediction adds the first and takes the second off (those A's peak held). Without that, it read 9.8%
    over the measured peak on gpt_accum and a new-user trial's Llama missed by 7.8%; now within 3% (gpt_accum +0.6%,
    bert_accum -2.2%, lora_accum exact, measured). A rerun's peak may also hold one unit's gathered parameters past
    FSDP's release of them, by gloo's thread timing (conftest.async_gather_slack): bert_accum measured 131,840 B over
    its prediction once (-4.8%), one BERT layer's gathered parameters; so may the first run's, whose peak the
    prediction starts from: lora_accum measured 131,328 B under it once (-8%, one unit's gathered parameters, on a
    fresh clone's quiet suite), exact in the two runs around it."""
    o = _ran(matrix[row])
    freed = o.finding.evidence["sharded_grads_freed_bytes"]
    held = o.report.memory.per_rank[str(o.report.memory.peak_rank)].peak_breakdown.get("sharded_grads", 0)
    # (LoRA's sharded gradients are a few KiB: a fresh clone's suite once read its peak before any were made, 0 held
    # and 0 freed, the prediction consistent with it; the recheck below still holds it to the measured peak)
    assert 0 < freed <= held or (row == "lora_accum" and freed == held == 0), (freed, held)
    rc = o.recheck()
    slack = max(u.unsharded_bytes or 0 for u in o.after.units)  # (async_gather_slack of the rerun)
    off = rc["peak_measured"] - rc["peak_predicted"]
    assert -0.03 * rc["peak_measured"] - slack <= off <= 0.03 * rc["peak_measured"] + slack, (rc, slack)


def _names_bound_at_top(code: str) -> set[str]:
    """The names a snippet binds where it is pasted (assignments, for-loop targets, imports; not inside a function
    or a comprehension, whose names stay their own)."""
    import ast

    out: set[str] = set()

    def visit(nodes):
        for n in nodes:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(n.name)
                continue
            for t in ([*n.targets] if isinstance(n, ast.Assign) else
                      [n.target] if isinstance(n, (ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor)) else []):
                out.update(x.id for x in ast.walk(t) if isinstance(x, ast.Name))
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                out.update((a.asname or a.name).split(".")[0] for a in n.names)
            for field in ("body", "orelse", "finalbody", "handlers"):
                visit(getattr(n, field, []) or [])

    visit(ast.parse(code).body)
    return out


@pytest.mark.parametrize("row", [r.name for r in M.ROWS if r.code])
def test_a_pasted_fix_binds_no_one_letter_name_and_fits_80_columns(matrix, row):
    """A new-user trial's script named its model ``m``: the async-unshard fix's ``for m in model.modules():``,
    pasted as printed, rebound it to the last submodule. A fix pasted into the user's code binds no one-letter
    name there (``module``, ``param``, ``wrapper``, ``start``); every Python fix the matrix prints is parsed. And
    every fix fits an 80-column terminal as the terminal prints it."""
    from fsdp_doctor.report_sections import FIX_LANGUAGES

    o = _ran(matrix[row])
    for f in o.findings:
        code, where = f.recommendation.code, f.recommendation.where
        if code and where not in FIX_LANGUAGES:
            short = {n for n in _names_bound_at_top(code) if len(n) == 1 and n != "_"}
            assert not short, (f.code, short, code)
        if code:  # within an 80-column terminal, as it prints it (comments rewrapped; code lines are never folded:
            # trials read 81-130 columns)
            from fsdp_doctor.present.fmt import fit_comments

            wide = [ln for ln in fit_comments(code).splitlines() if len(ln) > 80]
            assert not wide, (f.code, wide)


def test_a_gpu_gain_row_that_names_a_figure_must_also_lose_its_finding():
    """A GPU row checked by its step (gpu_gain: at least half the predicted gain measured) may keep its finding
    where its rule reads what the fix does not change (the loopback link's comm.bound); a row that names a figure must
    also lose the finding or halve it: compile.recompile_limit's GPU row, whose eager layers a rerun could leave eager
    and still run faster by chance. Known answers, constructed reports: a 30 ms step, 24 ms predicted."""
    import msgspec

    from fsdp_doctor.report_sections import Report

    def report(step_ms, eager):
        finding = {"code": "compile.recompile_limit", "severity": "warning", "title": "t",
                   "evidence": {"eager_count": eager},
                   "recommendation": {"text": "t", "code": "torch._dynamo.config.recompile_limit = 32",
                                      "where": "model"},
                   "predicted": {"step_ms_before": 30.0, "step_ms_after": 24.0}}
        return msgspec.convert({"steps": {"per_rank": {"0": {"count": 6, "p50_ms": step_ms}},
                                          "job": {"p50_ms": step_ms}},
                                "memory": {"peak_bytes": 1 << 20}, "findings": [finding] if eager else []}, Report)

    def problems(row, after_ms, eager_after):
        before = report(30.0, 8)
        o = M.Outcome(row, report=before, finding=before.findings[0], fix=M.fix_of(before.findings[0]),
                      after=report(after_ms, eager_after))
        return M.problems(o)

    figured = M.BY_NAME["gpu_hf_llama_recompile_limit"]
    assert figured.gpu_gain and figured.figure == "eager_count"
    assert problems(figured, 25.0, 0) == []
    assert problems(figured, 25.0, 8) == ["compile.recompile_limit neither gone nor improved after the fix"]
    assert problems(figured, 29.0, 0) == ["step 30.0 -> 29.0 ms, predicted 24.0 ms: under half the predicted gain"]
    stays = M.Row("gpu_x", "hf_llama", "compile.recompile_limit", gpu=True, profile=True, gpu_gain=True)
    assert problems(stays, 25.0, 8) == []
