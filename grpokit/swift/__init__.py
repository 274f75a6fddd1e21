"""ms-swift's plugin import paths, backed by grpokit: porting a plugin file means renaming its imports.

``from swift.X import Y`` becomes ``from grpokit.swift.X import Y`` (``sed -E 's/\\b(from|import) swift\\./\\1
grpokit.swift./'``). The names a GRPO plugin imports are here: ``infer_engine`` (``RequestConfig``,
``TransformersEngine`` and the protocol types), ``rewards`` (``ORM``, ``AsyncORM``, ``orms``, ``rm_plugins``,
``rm_plugin.DefaultRMPlugin``, ``orm.MathAccuracy`` ...), ``rollout`` (``multi_turn.MultiTurnScheduler``,
``multi_turns``, ``gym_env.Env``, ``envs``), ``template`` (``Template``, ``Messages``), ``utils``
(``get_logger``, ``to_device``), and for trainer plugins ``rlhf_trainers`` (``GRPOTrainer``), ``trainers``
(``TrainerFactory``), ``optimizers`` (``OptimizerCallback``, ``optimizers_map``) and ``callbacks``
(``TrainerCallback``, ``callbacks_map``). Registries are grpokit's own, so what a ported plugin registers is what
``--reward_funcs``/``--multi_turn_scheduler``/``--gym_env``/``--reward_model_plugin`` look up. A name ms-swift has
and this package lacks fails at import with Python's ImportError naming it. docs/porting.md lists the renames.
"""
