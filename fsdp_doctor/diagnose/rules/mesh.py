"""Device meshes: FSDP groups over some of the ranks that nothing combines."""

from __future__ import annotations

from .. import snippets as S
from ...units import fmt_mesh
from ..base import Context, Rule, register


@register
class UncombinedGroups(Rule):
    code = "mesh.uncombined_groups"
    name = "FSDP groups that never combine their gradients"
    description = ("The units shard over some of the ranks and the mesh has no replicate dim: each group of ranks "
                   "trains a model of its own, whose gradients are never averaged with the other groups'.")
    needs = ("units",)
    severities = ("info", "warning")

    def match(self, ctx: Context):
        cfg = ctx.config
        if cfg is None:
            return self.quiet("needs the run's configuration (fsdp_doctor.watch records it)")
        if cfg.mesh:
            return self.quiet(f"FSDP's mesh is {fmt_mesh(cfg.mesh)}: its dims beyond the shard dim replicate or "
                              "split the model (HSDP, tensor parallelism)")
        world = cfg.world_size
        shard = max((u.shard_size for u in cfg.units if u.shard_size), default=0)
        if not shard or shard >= world or world % shard:
            # where only some ranks train, world_size counts those (a trial's ranks 2-3 of 4 read "all 2 ranks")
            some = (f" that train the watched model (ranks {', '.join(map(str, cfg.world_ranks))} of the process "
                    "group; the doctor does not see the others)" if cfg.world_ranks else "")
            return self.quiet(f"the units shard over all {world} ranks{some}" if shard >= world else
                              "the units' shard size is not known" if not shard else
                              f"the units shard over {shard} of {world} ranks, not whole groups of them")
        groups = world // shard
        # the same units on every rank: replicas of one model (a pipeline's stages hold different layers)
        snaps = {tuple((u.name, u.param_count) for u in rd.config.units)
                 for rd in (getattr(ctx.run, "ranks", None) or {}).values() if rd.config is not None}
        same = len(snaps) <= 1
        parent, dim = cfg.fsdp_mesh_parent, cfg.fsdp_mesh_dim
        cut = (f" (your mesh is {f'[{dim!r}]' if dim else 'a 1-D sub-mesh'} of a {fmt_mesh(parent)} mesh)"
               if parent else "")
        text = (f"The units shard their parameters over {shard} of the {world} ranks{cut}, and FSDP's mesh has no "
                f"replicate dimension: the {world} ranks form {groups} groups of {shard}, and nothing the doctor "
                "sees averages the gradients across them. ")
        if same:
            text += (f"Every rank holds the same units: the {groups} groups train {groups} copies of the model, "
                     "each on its own data, that drift apart. For data parallelism across the groups (HSDP), pass "
                     f"fully_shard a 2-D mesh ({groups} replicas × {shard} shards) in place of its 1-D shard dim: "
                     "FSDP then all-reduces the gradients across the groups after each reduce-scatter. (Where your "
                     "loop averages the gradients across the groups itself, or the groups are meant to train apart, "
                     "this is as you intend.)")
        else:
            text += ("The groups hold different units (a pipeline's stages, or models meant to train apart): if "
                     "some of them are replicas of one model, their gradients need averaging across the groups "
                     f"(HSDP: a 2-D mesh, replicas × {shard} shards).")
        evidence = {"world size": world, "shard size": shard, "groups": groups, "same units on every rank": same}
        if parent:
            evidence["mesh cut from"] = fmt_mesh(parent)
        code = ""
        if same:
            plan = S.FSDP_MESH_USE.sub("hsdp_mesh", S.shard_plan(S.tree(ctx)))
            code = (f"# HSDP: each parameter sharded over {shard} ranks as now, replicated over the {groups} groups\n"
                    "hsdp_mesh = init_device_mesh('cuda' if torch.cuda.is_available() else 'cpu',\n"
                    f"                             ({groups}, {shard}), mesh_dim_names=('replicate', 'shard'))\n"
                    + plan)
        return [self.finding(
            "warning" if same else "info",
            f"{groups} groups of {shard} ranks train apart: no replicate dim combines their gradients",
            evidence, text, code)]
