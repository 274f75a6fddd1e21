"""``--verifiers_env NAME_OR_MODULE``: a ``verifiers`` (0.4) environment trains with its own tasks, rollouts and
rewards, the policy served through the trainer's OpenAI-compatible endpoint (docs/agents_envs.md).

verifiers 0.4 (``verifiers.v1``) builds an ``Env`` from a taskset (the tasks: prompt, system prompt, the task's
own fields), a harness per agent seat (the program that plays a task, talking to a model through verifiers' own
interception proxy) and the task's ``@vf.reward`` functions, which score each finished trace. grpokit plugs in
below all of that: each episode (``AgentScheduler``'s, one per request, ``num_generations`` per task) runs
``env.run_episode(task, ModelContext(...))`` with the model endpoint set to the episode's session of grpokit's
endpoint, so every model call verifiers makes is recorded token-in-token-out there and the episode's calls train
as its trajectory. The episode's reward is the traces' weighted reward sum (``Trace.reward``: each reward
function's score times its weight), the trainer's ``gym_reward`` column. Each reward function's score is logged
too, as a column of weight 0 (``rewards/<name>/mean``), so the total is the rubric's own. An episode that
verifiers marks failed (a harness or scoring error) is a failed episode: reward 0, nothing trained.

The environment: ``module:attr`` (an ``Env``, or a function returning one, e.g. ``my_env:load_environment``), a
module with a ``load_environment()``, else a taskset id ``verifiers.load_environment`` resolves (its agent seat
run as a local subprocess, not verifiers' default remote sandbox). The training rows are the taskset's tasks
(written to ``<output_dir>/verifiers_tasks.jsonl``, the prompt as ``messages`` and the task's index), unless
``--dataset`` is given: then its rows must carry that ``verifiers_task`` column. ``verifiers`` is imported only
here, when the option is used (the ``verifiers`` extra; its own test environment, scripts/setup_agents_env.sh).
"""

from __future__ import annotations

import importlib
import json
import os
import secrets
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from grpokit.agents.scheduler import SERVED_MODEL_NAME, AgentScheduler
from grpokit.errors import ConfigError, DataError, RolloutError
from grpokit.protocol import RequestConfig, RolloutInferRequest, RolloutOutput

TASK_COLUMN = "verifiers_task"  # a row's index into the environment's tasks
TASKS_FILE = "verifiers_tasks.jsonl"
SCORES_INFO = "verifiers_rewards"  # rollout_infos key: the episode's score per reward function
MAX_TASKS = 1_000_000  # an unbounded taskset is refused, not read forever


def _vf():
    import verifiers.v1 as vf  # the 'verifiers' extra: only --verifiers_env needs it

    return vf


def load_verifiers_env(spec: str):
    """The ``verifiers.v1.Env`` that ``--verifiers_env spec`` names (module docstring); ConfigError otherwise."""
    vf = _vf()
    module_name, sep, attr = spec.partition(":")
    if sep:
        try:
            obj = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ConfigError(
                f"--verifiers_env {spec}: cannot load {attr!r} from {module_name!r} ({type(e).__name__}: {e})"
            ) from e
        env = obj if isinstance(obj, vf.Env) else obj() if callable(obj) else obj
    else:
        try:
            module = importlib.import_module(spec)
        except ImportError:
            module = None
        if module is not None and callable(getattr(module, "load_environment", None)):
            env = module.load_environment()
        else:
            env = _load_by_id(vf, spec)
    if not isinstance(env, vf.Env):
        raise ConfigError(
            f"--verifiers_env {spec}: got {type(env).__name__}, not a verifiers.v1.Env; name an Env, "
            "a function returning one, or a taskset id"
        )
    return env


def _load_by_id(vf, spec: str):
    local = {"taskset": {"id": spec}, "agent": {"runtime": {"type": "subprocess"}}}
    try:
        try:
            config = vf.resolve_env_config(local)
        except ValueError:  # an env without the single 'agent' seat: its own runtime defaults
            config = vf.resolve_env_config({"taskset": {"id": spec}})
        return vf.load_environment(config)
    except (ImportError, ValueError, TypeError) as e:
        raise ConfigError(
            f"--verifiers_env {spec}: verifiers cannot load it as a taskset id "
            f"({type(e).__name__}: {str(e)[:300]}); give module:attr or an importable module with "
            "load_environment()"
        ) from e


def env_tasks(env) -> list:
    """The environment's tasks, in its taskset's order (an unbounded taskset is refused)."""
    if not env.taskset.bounded:
        raise ConfigError(
            f"--verifiers_env: {type(env.taskset).__name__} is unbounded; bound it where the env is "
            "built (env.taskset = env.taskset.take(N))"
        )
    tasks = []
    for task in env.taskset:
        tasks.append(task)
        if len(tasks) > MAX_TASKS:
            raise ConfigError(f"--verifiers_env: more than {MAX_TASKS} tasks; bound the taskset (take(N))")
    if not tasks:
        raise ConfigError("--verifiers_env: the environment's taskset has no tasks")
    return tasks


def task_messages(task) -> list[dict]:
    """A task's prompt as chat messages (its system prompt first), as the trainer's rows hold them."""
    from verifiers.v1.dialects.chat import message_to_wire  # the 'verifiers' extra (see _vf)

    data = task.data
    head = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if data.prompt is None:
        return head + [{"role": "user", "content": ""}]
    if isinstance(data.prompt, str):
        return head + [{"role": "user", "content": data.prompt}]
    return head + [message_to_wire(m) for m in data.prompt]


def write_task_rows(tasks: list, output_dir: str) -> str:
    """The tasks as training rows (``messages`` + ``verifiers_task``), written where the run's outputs go."""
    path = Path(output_dir) / TASKS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for k, task in enumerate(tasks):
            f.write(json.dumps({"messages": task_messages(task), TASK_COLUMN: k}) + "\n")
    return str(path)


def reward_names(tasks: list) -> list[str]:
    """The reward functions the tasks declare (``@vf.reward`` methods and plugged ones), in scoring order."""
    names: list[str] = []
    for task in tasks[:1] + tasks[-1:]:
        for fn in task.hooks("reward"):
            if fn.__name__ not in names:
                names.append(fn.__name__)
        names += [j.reward_name for j in task.plugged_judges() if j.reward_name not in names]
    return names


class RubricScore:
    """One reward function's score as a reward column (logged as ``rewards/<name>/mean``; weight 0: the episode
    reward already holds it, weighted). None where the episode has no score for it (a failed episode)."""

    def __init__(self, name: str) -> None:
        self.name = self.__name__ = name

    def __call__(self, completions: list[str], **kwargs: Any) -> list[float | None]:
        infos = kwargs.get("rollout_infos") or [{}] * len(completions)
        return [(info.get(SCORES_INFO) or {}).get(self.name) for info in infos]


class VerifiersScheduler(AgentScheduler):
    """``AgentScheduler`` whose agent is one ``env.run_episode`` per request (module docstring)."""

    def __init__(self, env, tasks: list, **kwargs) -> None:
        super().__init__(self.play, **kwargs)
        self.env, self.tasks = env, tasks
        self.reward_names = reward_names(tasks)
        self._scores: dict[str, dict[str, float]] = {}  # by the episode's base URL: its session

    @classmethod
    def from_env(cls, env, tasks: list, rollout_args, serve, infer_engine=None) -> VerifiersScheduler:
        return cls(
            env,
            tasks,
            serve=serve,
            concurrency=rollout_args.agent_concurrency,
            timeout=rollout_args.agent_timeout,
            infer_engine=infer_engine,
        )

    async def play(self, client, row: dict) -> float:
        """One episode of the row's task with the model at ``client``'s session; its reward (module docstring)."""
        vf = _vf()
        k = row.get(TASK_COLUMN)
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < len(self.tasks):
            raise DataError(
                f"--verifiers_env: row column {TASK_COLUMN!r} is {k!r}; it must index the "
                f"environment's {len(self.tasks)} tasks"
            )
        base_url = str(client.base_url).rstrip("/")
        # verifiers reads an endpoint's key from an environment variable: one of its own for each episode (the
        # key is the episode's session), there only while the episode runs
        var = f"GRPOKIT_EPISODE_KEY_{secrets.token_hex(8)}"
        os.environ[var] = client.api_key
        try:
            ctx = vf.ModelContext(
                model=SERVED_MODEL_NAME, client=vf.EvalClientConfig(base_url=base_url, api_key_var=var)
            )
            episode = await self.env.run_episode(self.tasks[k], ctx)
        finally:
            os.environ.pop(var, None)
        errors = [e for t in episode.traces for e in t.errors] + list(episode.errors)
        if not episode.ok:
            first = errors[0] if errors else None
            raise RolloutError(
                f"verifiers episode of task {k} failed: {f'{first.type}: {first.message}' if first else 'not ok'}"[:500]
            )
        self._scores[base_url] = _scores(episode)
        return float(sum(t.reward for t in episode.traces))

    async def async_infer(
        self, requests: list[RolloutInferRequest], request_config: RequestConfig
    ) -> list[RolloutOutput]:
        self._scores.clear()
        async with self.env.serving():  # verifiers' interception servers, for this rollout's episodes
            outputs = await super().async_infer(requests, request_config)
        for o in outputs:
            session = self.endpoint.base_url(SimpleNamespace(id=o.rollout_infos.get("episode_id")))
            o.rollout_infos[SCORES_INFO] = self._scores.get(session.rstrip("/"), {})
        self._scores.clear()
        return outputs


def _scores(episode) -> dict[str, float]:
    """Each reward function's score (unweighted), averaged over the episode's traces that have it."""
    seen: dict[str, list[float]] = {}
    for trace in episode.traces:
        for name, reward in trace.rewards.items():
            if reward is not None:
                seen.setdefault(name, []).append(float(reward.score))
    return {name: sum(v) / len(v) for name, v in seen.items()}


def rubric_columns(rubric: list[str] | None, funcs: list, names: list[str], weights: list[float] | None):
    """``funcs``/``names``/``weights`` with a weight-0 column per reward function of a verifiers environment
    (``rubric``: their names, ``reward_names(tasks)``; before the gym_reward weight, when ``weights`` gives one);
    the inputs unchanged without one (None)."""
    if rubric is None:
        return funcs, names, weights
    clash = sorted(set(names) & set(rubric))
    if clash:
        raise ConfigError(
            f"--reward_funcs {clash[0]}: the verifiers environment logs a reward function of that "
            "name already; drop it from --reward_funcs"
        )
    extra = [RubricScore(n) for n in rubric]
    w = list(weights) if weights else [1.0] * len(names)
    gym = w[len(names) :]  # the gym_reward weight, when given
    return [*funcs, *extra], [*names, *rubric], [*w[: len(names)], *[0.0] * len(extra), *gym]


def check_verifiers_options(rollout_args) -> None:
    """--verifiers_env against the options it cannot go with (ConfigError naming both)."""
    r = rollout_args
    if not r.verifiers_env:
        return
    for flag, value in (
        ("--agent", r.agent),
        ("--multi_turn_scheduler", r.multi_turn_scheduler),
        ("--gym_env", r.gym_env),
    ):
        if value:
            raise ConfigError(
                f"--verifiers_env {r.verifiers_env} and {flag} {value}: the environment plays its "
                "episodes itself; give one of them"
            )
    if r.vllm_mode == "server" or r.use_vllm:
        raise ConfigError(
            f"--verifiers_env {r.verifiers_env} with --vllm_mode server or --use_vllm true is not "
            "implemented (its episodes are recorded by the trainer's own endpoint over the in-process "
            "transformers engine); drop that option"
        )
