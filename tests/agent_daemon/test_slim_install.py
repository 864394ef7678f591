"""The daemon runs on GPU hosts with a slim install: it must never pull Django in."""

from __future__ import annotations

import subprocess
import sys

from tests.services import REPO_ROOT

DAEMON_MODULES = (
    "agents.daemon",
    "agents.daemon.__main__",
    "agents.daemon.config",
    "agents.daemon.client",
    "agents.daemon.commands",
    "agents.daemon.heartbeat",
    "agents.daemon.loop",
    "agents.daemon.nvml",
    "agents.daemon.registry",
    "agents.daemon.session",
    "agents.daemon.state",
    "tests.agent_daemon.recording",
)


def test_importing_the_daemon_does_not_import_django() -> None:
    script = (
        "import importlib, sys\n"
        f"for name in {DAEMON_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        "loaded = sorted(m for m in sys.modules if m == 'django' or m.startswith(('django.', 'rest_framework', 'jobs', 'controlplane', 'common', 'cluster', 'scheduler.models', 'agents.models')))\n"
        "print(loaded)\n"
        "sys.exit(1 if loaded else 0)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, env={}
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_help_and_bad_configuration() -> None:
    ok = subprocess.run(
        [sys.executable, "-m", "agents.daemon", "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0 and "--bootstrap-token" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "agents.daemon", "--heartbeat-interval", "soon"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": ""},
    )
    assert bad.returncode == 2
    assert (
        "--url / DYNARL_URL" in bad.stderr
        and "--heartbeat-interval / DYNARL_HEARTBEAT_INTERVAL_S" in bad.stderr
    )


def test_the_ray_backend_loads_the_training_stack_only_to_start_a_trainer_rank_or_a_driver() -> None:
    # An agent restarted on a GPU host is back in seconds: megatron-core (and torch's compiler
    # with it) comes in only when the agent first starts an actor whose module needs it.
    script = (
        "import sys\n"
        "from agents.backends.ray import backend\n"
        "from agents.backends.ray.actors import JOB_DRIVER_ACTOR, TRAINER_RANK_ACTOR, actor_class\n"
        "heavy = ('megatron', 'runtime.rl.trainer', 'runtime.rl.loop', 'agents.backends.ray.driver',\n"
        "         'agents.backends.ray.trainer_rank')\n"
        "def loaded():\n"
        "    return sorted(m for m in sys.modules if m in heavy or m.startswith('megatron.'))\n"
        "assert loaded() == [], loaded()\n"
        "assert actor_class(TRAINER_RANK_ACTOR).__name__ == 'TrainerRankWorker'\n"
        "assert actor_class(JOB_DRIVER_ACTOR).__name__ == 'JobDriver'\n"
        "assert 'megatron' in loaded() and 'agents.backends.ray.driver' in loaded(), loaded()\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
