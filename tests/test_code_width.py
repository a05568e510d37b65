"""A fix's Python code fitted to 80 columns after the framework rewrites indent it (diagnose/code_width.py):
known-answer cases, every one parsed to the same syntax tree before and after."""

import ast

from fsdp_doctor.diagnose.code_width import fit

# reshard.zero2_affordable's fix for a Phi-3 under the Trainer as it was printed (lines of 105, 169 and 88 columns),
# with a line whose string holds a comma and a "#" and whose brackets nest
TRAINER_FIX = '''from transformers import TrainerCallback


class DoctorFix(TrainerCallback):  # runs once the Trainer has sharded the model and built the optimizer
    def on_train_begin(self, args, state, control, model=None,
                       optimizer=None, **kwargs):
        {LONG}
        names = ['model.layers.2', 'model.layers.5', 'model.layers.1', 'model.layers.0',
                 'model.layers.4', 'model.layers.3', 'model.embed_tokens']
        x = print(1, "a, b, c # not a comment, really", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], max(min(1, 2), 3), 4)
        for name in names:
            model.get_submodule(name).set_reshard_after_forward(False, recurse=False)


trainer.add_callback(DoctorFix())'''.replace("{LONG}", "# (accelerate's plugin's reshard_after_forward is all or none: "
                                              "every unit's before 1.14; from 1.14 on it keeps the root and the "
                                              "[final norm, output head] unit gathered)")


def _words(code: str) -> list[str]:
    return [w for ln in code.splitlines() if ln.lstrip().startswith("#") or "  # " in ln
            for w in ln.split("#", 1)[1].split()]


def test_a_trainer_callbacks_fix_fits_80_columns_and_means_the_same():
    out = fit(TRAINER_FIX)
    lines = out.splitlines()
    assert max(map(len, lines)) <= 80, out
    assert ast.dump(ast.parse(out)) == ast.dump(ast.parse(TRAINER_FIX))
    # the comments' words all kept, in order; the trailing one above its line, at its indent
    assert _words(out) == _words(TRAINER_FIX)
    at = lines.index("class DoctorFix(TrainerCallback):")
    assert lines[at - 1] == "# runs once the Trainer has sharded the model and built the optimizer"
    # the long comment rewrapped at its indent, every line a comment
    i = next(i for i, ln in enumerate(lines) if "accelerate's plugin's" in ln)
    assert lines[i:i + 3] == ["        # (accelerate's plugin's reshard_after_forward is all or none: every",
                              "        # unit's before 1.14; from 1.14 on it keeps the root and the [final",
                              "        # norm, output head] unit gathered)"], lines[i:i + 3]
    # the names list flowed on under its bracket: no item left alone on a line
    j = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("names = ["))
    assert lines[j:j + 3] == ["        names = ['model.layers.2', 'model.layers.5', 'model.layers.1',",
                              "                 'model.layers.0', 'model.layers.4', 'model.layers.3',",
                              "                 'model.embed_tokens']"], lines[j:j + 3]
    # the string is never split and its "#" never taken for a comment
    assert '"a, b, c # not a comment, really"' in out


def test_code_that_fits_or_cannot_be_broken_is_left_as_it_is():
    short = "model.set_reshard_after_forward(False)  # every unit\n"
    assert fit(short) is short
    # no bracket and no comment: nothing to break at
    chain = "unit = model" + ".encoder.stages[0]._checkpoint_wrapped_module.layers" * 2
    chain = chain.replace("[0]", "")
    assert fit(chain) == chain
    # a fragment that does not parse (a line of a loop the user has): returned as given
    fragment = "    loss = model(batch)  # " + "the loss of this micro-batch, scaled by the accumulation " * 2 + "\n  x"
    assert fit(fragment) == fragment


def test_a_line_broken_inside_a_call_keeps_its_arguments_in_order_and_under_their_bracket():
    code = ("fully_shard(model.get_submodule('transformer.h.0'), mesh=mesh, reshard_after_forward=False, "
            "mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))")
    out = fit(code)
    assert out.splitlines() == [
        "fully_shard(model.get_submodule('transformer.h.0'), mesh=mesh,",
        "            reshard_after_forward=False,",
        "            mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,",
        # (its bracket past half the width: four columns right of the piece it continues)
        "                reduce_dtype=torch.float32))"], out
    assert ast.dump(ast.parse(out)) == ast.dump(ast.parse(code))


def test_a_module_name_too_long_for_its_line_splits_at_a_dot_into_adjacent_strings():
    """A ConvNeXt's checkpointed layers in a Trainer callback's forward_order (96 columns each): no comma fits, so
    each name splits after a dot into two adjacent strings, Python's one constant, every piece lined up."""
    code = ("def on_train_begin(model):\n        forward_order = [model.get_submodule('convnext.encoder.stages.0."
            "_checkpoint_wrapped_module.layers.0'),\n"
            "                         model.get_submodule('convnext.encoder.stages.1')]")
    out = fit(code)
    assert out.splitlines()[1:] == [
        "        forward_order = [model.get_submodule('convnext.encoder.stages.0.'",
        "                             '_checkpoint_wrapped_module.layers.0'),",
        "                         model.get_submodule('convnext.encoder.stages.1')]"], out
    assert ast.dump(ast.parse(out)) == ast.dump(ast.parse(code))


def test_a_comment_paragraph_flows_on_into_its_next_line():
    """optim.unfused_step's fix under the Trainer: its two-line comment, indented by 8, left "# implementation," alone
    on a line when only its first line was rewrapped."""
    code = ("def on_train_begin(optimizer):\n"
            "    for group in optimizer.param_groups:\n"
            "        # after building the optimizer, before its first step: its fused implementation,\n"
            "        # one kernel per update, no foreach intermediates\n"
            "        group['foreach'], group['fused'] = False, True")
    out = fit(code)
    assert out.splitlines()[1:] == [
        "    for group in optimizer.param_groups:",
        "        # after building the optimizer, before its first step: its fused",
        "        # implementation, one kernel per update, no foreach intermediates",
        "        group['foreach'], group['fused'] = False, True"], out


def test_the_words_that_say_where_a_fix_goes_stay_whole():
    """The phrase snippets.fix_place reads (BEFORE_SHARDING) is never split over two lines, nor the marker of a
    two-part fix's place (SHARDING_GOES_HERE) flowed into the comment above it."""
    from fsdp_doctor.diagnose.snippets import BEFORE_SHARDING, SHARDING_GOES_HERE

    code = ("def plan(model):\n"
            "    # the first blocks, in forward order: whatever the rule said, " + BEFORE_SHARDING
            + " (before it is sharded)\n    " + SHARDING_GOES_HERE + "\n    return model")
    out = fit(code)
    assert max(map(len, out.splitlines())) <= 80, out
    assert BEFORE_SHARDING in out and "    " + SHARDING_GOES_HERE in out.splitlines(), out
