"""torchtune's own recipe (optional: skipped where torchtune is not importable; 0.6.1 with torchao 0.14.1 on torch 2.13
here). Its full_finetune_distributed accumulates gradients without turning FSDP2's gradient sync off; attached as the
README says (a `tune cp` copy, two lines in its train()), the doctor said its fix for "your training loop" on a
`model` the recipe calls `self._model` and with a flag it does not have. Now the fix is said in the recipe's words;
pasted where it says, before `current_loss.backward()`, the finding goes and the losses stay equal to the bit. The
recipe runs as its users run it: `tune run --nproc_per_node 2 recipe.py --config cfg.yaml`, here on CPU (two lines of
it changed: its get_memory_stats and cleanup_before_training raise there), a tiny Llama-2-shaped checkpoint, a
tokenizer and a text file made locally."""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import assert_gc_fixed, REPO, child_pythonpath

pytest.importorskip("torchtune")
pytest.importorskip("sentencepiece")

_CONFIG = """\
output_dir: {out}
tokenizer: {{_component_: torchtune.models.llama2.llama2_tokenizer, path: {assets}/tok.model, max_seq_len: 64}}
dataset: {{_component_: torchtune.datasets.text_completion_dataset, source: text, data_files: {assets}/corpus.txt,
          column: text, split: train, packed: False}}
seed: 0
shuffle: True
model: {{_component_: torchtune.models.llama2.llama2, vocab_size: 4096, num_layers: 2, num_heads: 4, num_kv_heads: 4,
        embed_dim: 64, max_seq_len: 256, intermediate_dim: 128}}
checkpointer: {{_component_: torchtune.training.FullModelHFCheckpointer, checkpoint_dir: {assets}/ckpt,
               checkpoint_files: [model.safetensors], recipe_checkpoint: null, output_dir: {out}, model_type: LLAMA2}}
resume_from_checkpoint: False
batch_size: 2
epochs: 1
optimizer: {{_component_: torch.optim.AdamW, fused: False, lr: 2e-5}}
loss: {{_component_: torchtune.modules.loss.CEWithChunkedOutputLoss}}
max_steps_per_epoch: 10
gradient_accumulation_steps: 2
clip_grad_norm: 1.0
compile: False
optimizer_in_bwd: False
device: cpu
enable_activation_checkpointing: True
dtype: fp32
metric_logger: {{_component_: torchtune.training.metric_logging.DiskLogger, log_dir: {out}/logs}}
log_every_n_steps: 1
log_peak_memory_stats: False
"""


# knowledge distillation: a LoRA student and a teacher of the same shape, each from the checkpoint, both sharded
_KD_CONFIG = _CONFIG.replace(
    "model: {{_component_: torchtune.models.llama2.llama2,",
    "model: {{_component_: torchtune.models.llama2.lora_llama2, lora_attn_modules: [q_proj, v_proj, output_proj],\n"
    "        apply_lora_to_mlp: True, lora_rank: 8, lora_alpha: 16, lora_dropout: 0.0,\n       ") + """\
teacher_model: {{_component_: torchtune.models.llama2.llama2, vocab_size: 4096, num_layers: 2, num_heads: 4,
                num_kv_heads: 4, embed_dim: 64, max_seq_len: 256, intermediate_dim: 128}}
teacher_checkpointer: {{_component_: torchtune.training.FullModelHFCheckpointer, checkpoint_dir: {assets}/ckpt,
                       checkpoint_files: [model.safetensors], recipe_checkpoint: null, output_dir: {out}/teacher,
                       model_type: LLAMA2}}
kd_loss: {{_component_: torchtune.modules.loss.ForwardKLWithChunkedOutputLoss}}
kd_ratio: 0.5
lr_scheduler: {{_component_: torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup, num_warmup_steps: 2}}
"""


# DPO with LoRA: the reference is the model with its adapters off; preference pairs from a local JSON file
_DPO_CONFIG = _KD_CONFIG.split("teacher_model:")[0].replace(
    "dataset: {{_component_: torchtune.datasets.text_completion_dataset, source: text, data_files: {assets}/corpus.txt,\n"
    "          column: text, split: train, packed: False}}",
    "dataset: {{_component_: torchtune.datasets.preference_dataset, source: json, data_files: {assets}/pref.json, "
    "split: train}}").replace(
    "loss: {{_component_: torchtune.modules.loss.CEWithChunkedOutputLoss}}",
    "loss: {{_component_: torchtune.rlhf.loss.DPOLoss, beta: 0.1, label_smoothing: 0}}") + (
    "lr_scheduler: {{_component_: torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup, "
    "num_warmup_steps: 2}}\n")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A text file, a sentencepiece tokenizer trained on it and a 2-layer Llama checkpoint in HF's format."""
    d = tmp_path_factory.mktemp("tune_assets")
    code = textwrap.dedent(f"""
        import json, random, torch, sentencepiece as spm
        from transformers import LlamaConfig, LlamaForCausalLM
        random.seed(0)
        words = "the quick brown fox jumps over a lazy dog while sharded ranks gather their parameters".split()
        with open({str(d / 'corpus.txt')!r}, "w") as f:
            for _ in range(200):
                f.write(" ".join(random.choice(words) for _ in range(random.randint(20, 70))) + "\\n")
        def said(lo, hi):
            return " ".join(random.choice(words) for _ in range(random.randint(lo, hi)))
        pairs = []
        for _ in range(96):  # preference pairs: one prompt, a chosen and a rejected answer
            q = said(5, 12)
            pairs.append({{"chosen": [{{"role": "user", "content": q}}, {{"role": "assistant", "content": said(5, 20)}}],
                          "rejected": [{{"role": "user", "content": q}}, {{"role": "assistant", "content": said(5, 20)}}]}})
        json.dump(pairs, open({str(d / 'pref.json')!r}, "w"))
        spm.SentencePieceTrainer.train(input={str(d / 'corpus.txt')!r}, model_prefix={str(d / 'tok')!r},
            vocab_size=120, hard_vocab_limit=False, model_type="bpe", bos_id=1, eos_id=2, unk_id=0, pad_id=-1)
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256, rms_norm_eps=1e-5,
            tie_word_embeddings=False)).save_pretrained({str(d / 'ckpt')!r}, safe_serialization=True)
    """)
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=300)
    return d


def _tune(*args, cwd, env=None, timeout=400) -> str:
    """torchtune's command line (its `tune` entry point), its output; the whole group killed on a timeout."""
    p = subprocess.Popen([sys.executable, "-m", "torchtune._cli.tune", *args], cwd=cwd, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        raise AssertionError(f"tune {args[0]}: no end in {timeout} s\n{out[-3000:]}") from None
    errors = [ln for ln in out.splitlines() if "Error" in ln and "ChildFailedError" not in ln]
    (Path(cwd) / "tune.log").write_text(out)  # (its whole output, kept beside the run)
    assert p.returncode == 0, "\n".join(errors[:6]) + "\n" + out[-2000:]
    return out


def _recipe(tmp_path, recipe: str, fix: str = "", watched: bool = True, sharded: str = "",
            pass_layers: bool = False, after_binding: tuple[str, str] | None = None, setup_end: str = "",
            after_step: str = "", imports: str = "") -> Path:
    """The recipe copied as its users copy it, attached as the README says (unless not ``watched``), ``fix`` pasted
    before its backward, ``sharded`` after the training.shard_model(...) call of its _setup_model, (``pass_layers``)
    custom_sharded_layers passed to the _setup_model call that builds the model it trains, ``after_binding``
    (name, code) right after the statement that binds that name, ``setup_end`` at the end of its setup() and
    ``after_step`` after train()'s ``self.global_step += 1``, ``imports`` at the top of the file."""
    path = tmp_path / "recipe.py"
    _tune("cp", recipe, str(path), cwd=tmp_path)
    s = path.read_text()

    def once(old, new, count=1):
        nonlocal s
        assert s.count(old) == count, old
        s = s.replace(old, new)

    # on a CPU: torchtune reads CUDA memory stats on rank 0 and empties a cache torch.cpu lacks; knowledge
    # distillation asks for NCCL
    n = s.count("        if self._is_rank_zero:\n            memory_stats = training.get_memory_stats(")
    once("        if self._is_rank_zero:\n            memory_stats = training.get_memory_stats(",
         "        if self._is_rank_zero and self._device.type == 'cuda':\n"
         "            memory_stats = training.get_memory_stats(", max(n, 1))
    once("        training.cleanup_before_training()\n",
         "        if self._device.type == 'cuda':\n            training.cleanup_before_training()\n")
    s = s.replace('init_process_group("cuda:nccl,cpu:gloo")', 'init_process_group("gloo")')
    # the README's lines: watch() around the epochs' loop (given the per-parameter optimizers' map under
    # optimizer_in_bwd), doctor.step() before the step's count goes up
    start = "        for curr_epoch in range(self.epochs_run, self.total_epochs):\n"
    end = "        self._profiler.stop()\n"
    i = s.index(start)
    j = s.index(end) if end in s else s.index("\n    def ", i) + 1  # (the loop ends train(): DPO's, no profiler)
    if watched:
        s = (s[:i] + "        import fsdp_doctor, os\n"
             "        optimizer = getattr(self, '_optim_ckpt_wrapper', self._optimizer)\n"
             "        with fsdp_doctor.watch(self._model, optimizer, out_dir=os.environ['DOCTOR_OUT']) as doctor:\n"
             + textwrap.indent(s[i:j], "    ") + s[j:])
        once("                        self.global_step += 1\n",
             "                        doctor.step()\n                        self.global_step += 1\n")
    if fix:
        m = re.search(r"^( *)current_loss\.backward\(\)\n", s, re.M)
        s = s[:m.start()] + textwrap.indent(fix + "\n", m.group(1)) + s[m.start():]
    if sharded:
        i = s.index("        training.shard_model(", s.index("    def _setup_model("))
        i = s.index("        )\n", i) + len("        )\n")
        s = s[:i] + textwrap.indent(sharded + "\n", "        ") + s[i:]
    if after_binding:
        name, code = after_binding
        node = next(n for n in ast.walk(ast.parse(s)) if isinstance(n, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == name for tg in n.targets for t in ast.walk(tg)))
        lines = s.splitlines(keepends=True)
        first = lines[node.lineno - 1]
        s = ("".join(lines[:node.end_lineno]) + textwrap.indent(code + "\n", first[:len(first) - len(first.lstrip())])
             + "".join(lines[node.end_lineno:]))
    if imports:
        once("\nimport torch\n", f"\nimport torch\n{imports}\n")
    if setup_end:
        i = s.index("\n    def ", s.index("    def setup(self, cfg")) + 1
        s = s[:i] + textwrap.indent(setup_end + "\n", " " * 8) + "\n" + s[i:]
    if after_step:
        m = re.search(r"^( *)self\.global_step \+= 1\n", s, re.M)
        s = s[:m.end()] + textwrap.indent(after_step + "\n", m.group(1)) + s[m.end():]
    if pass_layers:
        once("        self._model = self._setup_model(\n",
             "        self._model = self._setup_model(\n"
             "            custom_sharded_layers=cfg.get('custom_sharded_layers', None),\n")
    path.write_text(s)
    return path


def _run(tmp_path, assets, name: str, fix: str = "", config: str = "", settings: dict | None = None,
         watched: bool = True, recipe: str = "full_finetune_distributed", template: str = _CONFIG,
         overrides: tuple[str, ...] = (), **edits):
    """(the report of the recipe's run, None where not ``watched``; its final loss as its progress bar prints it):
    ``fix`` pasted before the recipe's backward (``edits``: _recipe's others), ``config`` lines added to its config
    (``template``), ``settings`` in place of its own, ``overrides`` (KEY=VALUE) after --config."""
    import fsdp_doctor

    d = tmp_path / name
    d.mkdir()
    cfg = d / "cfg.yaml"
    text = template.format(out=d / "out", assets=assets)
    for key, value in (settings or {}).items():
        text, n = re.subn(rf"^{key}: .*$", f"{key}: {value}", text, flags=re.M)
        assert n == 1, key
    cfg.write_text(text + config + "\n")
    env = {**os.environ, "PYTHONPATH": child_pythonpath(REPO), "OMP_NUM_THREADS": "1",
           "DOCTOR_OUT": str(d / "doctor")}
    # (the recipe by its name in the run's folder, as tune cp leaves it: given a path, tune run read it as a module's)
    out = _tune("run", "--nproc_per_node", "2", _recipe(d, recipe, fix, watched, **edits).name, "--config", str(cfg),
                *overrides, cwd=d, env=env)
    losses = re.findall(r"\|\d+\|Loss: ([0-9.]+)", out)  # (its last step's: the 10th, or max_steps_per_epoch's)
    assert losses, out[-3000:]
    return fsdp_doctor.build_report(fsdp_doctor.load_run(d / "doctor")) if watched else None, losses[-1]


@pytest.mark.long
def test_recipe_accumulation_fix_pasted_where_said(tmp_path, assets):
    before, loss = _run(tmp_path, assets, "before")
    f = {f.code: f for f in before.findings}.get("accum.sync_every_micro_batch")
    assert f is not None, [g.code for g in before.findings]
    rec = f.recommendation
    assert rec.where == "torchtune_backward" and "self._model.set_requires_gradient_sync" in rec.code, rec
    # the root's modules, where worth units of their own, as the config's line; the chunked head stays in the root
    # (a unit of its own, its collectives followed its calls per chunk: the trial's run aborted)
    wrap = {f.code: f for f in before.findings}.get("wrap.params_in_root")
    config = ""
    if wrap is not None:
        config = wrap.recommendation.code
        assert wrap.recommendation.where == "torchtune_config", wrap.recommendation
        assert config.splitlines()[-1] == "custom_sharded_layers: ['tok_embeddings']", config
    after, loss_after = _run(tmp_path, assets, "after", rec.code, config)
    assert not {"accum.sync_every_micro_batch", "wrap.params_in_root"} & {g.code for g in after.findings}
    assert loss_after == loss, (loss, loss_after)


@pytest.mark.long
def test_recipe_fused_optimizer_said_in_its_config_and_run_so(tmp_path, assets):
    """The config's AdamW with fused: False steps the shards in torch's for-loop on the CPU (optim.unfused_step, a
    note on a CPU run). Its fix read ``for group in optimizer.param_groups`` "after your optimizer is built", where the
    recipe's optimizer is ``self._optimizer`` and built from the config: it is the config's key now, run as printed
    (its keys as KEY=VALUE after --config, as the place says): the rule quiet, the optimizer's own time down by at
    least half the predicted saving, the loss as the loop's to 4 digits."""
    import yaml

    settings = {"gradient_accumulation_steps": 1}
    before, loss = _run(tmp_path, assets, "loop", settings=settings)
    (f,) = [f for f in before.findings if f.code == "optim.unfused_step"]
    rec = f.recommendation
    assert rec.where == "torchtune_config" and "recipe.py" in rec.text, (rec.where, rec.text)
    keys = yaml.safe_load(rec.code)
    assert keys == {"optimizer": {"fused": True}}, rec.code
    overrides = tuple(f"{k}.{sub}={v}" for k, d in keys.items() for sub, v in d.items())
    after, loss_after = _run(tmp_path, assets, "fused", settings=settings, overrides=overrides)
    s = next(s for s in after.rules if s.code == "optim.unfused_step")
    assert (s.status, s.reason) == ("quiet", "AdamW runs fused already"), (s.status, s.reason)
    opt = {name: r.steps.job.phases_p50_ms["optimizer"] for name, r in (("loop", before), ("fused", after))}
    predicted = f.evidence["fused_optimizer_ms_est"]
    assert opt["fused"] < opt["loop"] - (opt["loop"] - predicted) / 2, (opt, predicted)
    assert float(loss_after) == pytest.approx(float(loss), rel=1e-4), (loss, loss_after)


@pytest.mark.long
def test_recipe_optimizer_in_backward_state_and_time_counted(tmp_path, assets):
    """optimizer_in_bwd: True, watched with the map of per-parameter optimizers the recipe keeps: AdamW's moments
    are the optimizer state to the byte, their steps' time the optimizer's; the loss equal to the unwatched run's."""
    from fsdp_doctor.present.fmt import optimizer_fact

    settings = {"optimizer_in_bwd": "True", "gradient_accumulation_steps": 1, "clip_grad_norm": "null"}
    report, loss = _run(tmp_path, assets, "in_bwd", settings=settings)
    _, unwatched = _run(tmp_path, assets, "in_bwd_unwatched", settings=settings, watched=False)
    assert loss == unwatched, (loss, unwatched)
    assert optimizer_fact(report.run) == "AdamW in backward (21 per-parameter optimizers)"
    for rank, mr in report.memory.per_rank.items():
        bd = mr.peak_breakdown
        assert bd["optimizer_state"] == 2 * bd["sharded_params"] + 4 * 21, (rank, bd)
    assert report.steps.job.phases_p50_ms["optimizer"] > 0


@pytest.mark.long
def test_distillation_recipe_teacher_said_and_its_plan_pasted_with_the_recipe_line(tmp_path, assets):
    """knowledge_distillation_distributed: the teacher's forward said under the step table as another model's work;
    what its train() all-reduces recorded as it writes it; with the student's root kept gathered (reshard.last_unit's
    fix pasted where it says), wrap.params_in_root's plan says the recipe's missing line (its setup() passes
    custom_sharded_layers to the teacher's _setup_model only): pasted with the config line, the finding goes, the
    peak as predicted, the loss equal."""
    from fsdp_doctor.present.fmt import apart_texts

    kd = dict(recipe="knowledge_distillation_distributed", template=_KD_CONFIG)
    report, _ = _run(tmp_path, assets, "kd", **kd)
    assert "other-models" in dict(apart_texts(report.steps)), apart_texts(report.steps)
    last = {f.code: f for f in report.findings}.get("reshard.last_unit")
    assert last is not None and last.recommendation.where == "torchtune_setup", [f.code for f in report.findings]
    kept, loss = _run(tmp_path, assets, "kd_kept", sharded=last.recommendation.code, **kd)
    wrap = {f.code: f for f in kept.findings}.get("wrap.params_in_root")
    assert wrap is not None, [f.code for f in kept.findings]
    code = wrap.recommendation.code
    assert '#     custom_sharded_layers=cfg.get("custom_sharded_layers", None),' in code, code
    after, loss_after = _run(tmp_path, assets, "kd_units", sharded=last.recommendation.code, pass_layers=True,
                             config=code, **kd)
    assert "wrap.params_in_root" not in {f.code for f in after.findings}
    assert abs(after.memory.peak_bytes / wrap.predicted.peak_bytes_after - 1) < 0.01, (after.memory, wrap.predicted)
    assert loss_after == loss, (loss, loss_after)


@pytest.mark.long
def test_dpo_recipe_reference_logits_kept_and_freed_where_said(tmp_path, assets):
    """lora_dpo_distributed binds its reference forward's logits to `_` and never reads them: memory.outputs_kept
    named `del outputs`, which that recipe has no name for. Now it names `_`; pasted right after the line that binds
    it, the finding goes, the peak falls as predicted (the peak rank's), the loss stays equal."""
    dpo = dict(recipe="lora_dpo_distributed", template=_DPO_CONFIG)
    before, loss = _run(tmp_path, assets, "dpo", **dpo)
    kept = {f.code: f for f in before.findings}.get("memory.outputs_kept")
    assert kept is not None, [f.code for f in before.findings]
    names = kept.evidence["unread_names"]
    assert names == ["_"] and kept.recommendation.code.splitlines()[-1] == "del _", kept.recommendation
    after, loss_after = _run(tmp_path, assets, "dpo_fixed", after_binding=("_", kept.recommendation.code), **dpo)
    assert "memory.outputs_kept" not in {f.code for f in after.findings}
    assert after.memory.peak_bytes <= kept.predicted.peak_bytes_before, after.memory
    rank = str(before.memory.peak_rank)
    assert after.memory.per_rank[rank].peak_bytes == kept.predicted.peak_bytes_after, after.memory.per_rank[rank]
    assert loss_after == loss, (loss, loss_after)


@pytest.mark.long
def test_recipe_gc_fix_said_for_its_setup_and_train_and_pasted_there(tmp_path, assets):
    """Code before the recipe's backward that keeps many objects alive (200k for the run, 50k a step for 3 steps) and
    drops 35k reference cycles a step: the collector's full collections traverse them inside the steps (jitter.gc). Its
    fix read "after your optimizer is built", a collect_between_steps for a loop the recipe owns; it is said for the
    recipe's setup() (set-up frozen, the collector off) and its train() (a collection every N optimizer steps, on
    self.global_step); pasted where its comments say, the rule is quiet, the GC's share under its threshold but for the
    fix's one collection (after step N, its period: the run is longer), the mean step down by at least half the
    predicted gain, the loss as without it."""
    # (the fix's period 14-15 steps: the run's 18 pass it)
    settings = {"gradient_accumulation_steps": 1, "max_steps_per_epoch": 18}
    held = ("from fsdp_doctor.workloads.train import hold_objects, make_garbage\nhold_objects(200_000)\n"
            "make_garbage(35_000)")
    before, loss = _run(tmp_path, assets, "gc", held, settings=settings)
    (f,) = [f for f in before.findings if f.code == "jitter.gc"]
    rec = f.recommendation
    assert rec.where == "torchtune_recipe" and "collect_between_steps" not in rec.code, (rec.where, rec.code)
    # its imports at the top of the file, as their note says; each part where its comment says
    head, setup, train = re.split(r"^(?=# in setup\(\)|# in train\(\))", rec.code, flags=re.M)
    assert head.startswith("# imports: at the top of your file") and "import gc" in head, rec.code
    assert setup.startswith("# in setup(), at its end") and "gc.freeze()" in setup and "gc.disable()" in setup
    assert train.startswith("# in train(), after self.global_step += 1") and "if self.global_step % " in train
    after, loss_after = _run(tmp_path, assets, "gc_fixed", held, settings=settings, setup_end=setup.strip(),
                             after_step=train.strip(), imports=head.strip())
    assert f.evidence["collect_every_steps"] < 17, f.evidence  # (its collection line runs: after step N, once)
    assert_gc_fixed(f, before, after, tmp_path / "gc_fixed" / "doctor")
    assert loss_after == loss, (loss, loss_after)
