"""``dynarl``: submit, watch and steer RL jobs from a terminal, through the REST API.

Exit codes: 0 success; 1 the API answered an error or could not be reached; 2 usage (bad
arguments, no token configured, an unreadable file). See docs/cli.md.
"""

from __future__ import annotations

import argparse
import getpass
import json
import socket
import sys
import urllib.parse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from cli import config, tables
from cli.client import ApiClient, ApiError, FieldProblem, Unreachable, cookie, session_opener

EXIT_OK = 0
EXIT_API_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

JOB_STATES = ("pending", "admitted", "running", "paused_scheduling", "succeeded", "failed", "cancelled")
MIGRATION_STATES = ("planned", "running", "rolling_back", "committed", "rolled_back", "failed")
NODE_STATUSES = ("ready", "lost", "drained")
EXPORTS = {"migrations": "/api/v1/migrations/export/", "audit": "/api/v1/audit-events/export/"}
ADMIN_LOGIN_PATH = "/admin/login/"
LOGIN_PATH = "/login/"


class UsageError(Exception):
    """The command line or the local setup is wrong; nothing was sent."""


class Cli:
    """One invocation: parsed arguments, where to print, and a client built on demand."""

    def __init__(self, args: argparse.Namespace, out: TextIO, err: TextIO) -> None:
        self.args = args
        self.out = out
        self.err = err

    @property
    def as_json(self) -> bool:
        return bool(getattr(self.args, "json", False))

    def settings(self) -> config.Settings:
        try:
            return config.resolve(getattr(self.args, "url", None), getattr(self.args, "token", None))
        except config.ConfigError as exc:
            raise UsageError(str(exc)) from exc

    def client(self) -> ApiClient:
        settings = self.settings()
        if not settings.token:
            raise UsageError(
                f"no API token for {settings.url}: run 'dynarl login', or pass --token / set DYNARL_TOKEN"
            )
        return ApiClient(settings.url, settings.token)

    def print(self, text: str = "") -> None:
        self.out.write(text + "\n")

    def print_json(self, value: Any) -> None:
        self.out.write(json.dumps(value, indent=2, sort_keys=True) + "\n")


# --- commands ----------------------------------------------------------------------------------


def cmd_login(cli: Cli) -> int:
    """Exchange a username and password (through the server's login form) for an API token,
    or check a token given on stdin, and save it with the URL in the config file."""
    args = cli.args
    url = cli.settings().url
    if args.with_token:
        token = sys.stdin.readline().strip()
        if not token:
            raise UsageError("--with-token reads the token from stdin, and stdin was empty")
        me = ApiClient(url, token).get("/api/v1/whoami/")
        username = str(me["username"])
    else:
        username = args.username or input("Username: ").strip()
        password = sys.stdin.readline().rstrip("\n") if args.password_stdin else getpass.getpass("Password: ")
        if not username or not password:
            raise UsageError("a username and a password are needed")
        token = session_login_token(url, username, password, args.login_path, args.token_name)
        me = ApiClient(url, token).get("/api/v1/whoami/")
    path = config.write_file({"url": url, "token": token, "username": username})
    if cli.as_json:
        cli.print_json({"url": url, "username": username, "role": me.get("role"), "config": str(path)})
    else:
        cli.print(f"logged in to {url} as {username} ({me.get('role')}); token saved in {path}")
    return EXIT_OK


def session_login_token(url: str, username: str, password: str, login_path: str, token_name: str) -> str:
    """Django's login form (CSRF cookie, then the form post), then POST /api/v1/tokens/ with the
    session. The session itself is dropped: only the token is kept."""
    opener, jar = session_opener()
    client = ApiClient(url, opener=opener)
    client.request("GET", login_path, headers={"Accept": "text/html"})
    csrf = cookie(jar, "csrftoken")
    if csrf is None:
        raise ApiError(
            0, "no_login_form", f"{url}{login_path} set no CSRF cookie: is it a Django login page?"
        )
    form = urllib.parse.urlencode(
        {"username": username, "password": password, "csrfmiddlewaretoken": csrf, "next": login_path}
    )
    client.request(
        "POST",
        login_path,
        body=form.encode(),
        content_type="application/x-www-form-urlencoded",
        headers={"Accept": "text/html", "Referer": client.url(login_path)},
    )
    if cookie(jar, "sessionid") is None:
        hint = " (the admin login admits staff accounts only)" if login_path == ADMIN_LOGIN_PATH else ""
        raise ApiError(401, "login_failed", f"{url} refused the username or password{hint}")
    created = client.request(
        "POST",
        "/api/v1/tokens/",
        json_body={"name": token_name},
        # Django rotates the CSRF token at login: send the new one.
        headers={"X-CSRFToken": cookie(jar, "csrftoken") or csrf, "Referer": client.url("/api/v1/tokens/")},
    ).json()
    return str(created["key"])


def read_spec(path: str) -> tuple[bytes, str]:
    """The file's bytes and the content type the API parses them with."""
    try:
        data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if not data.strip():
        raise UsageError(f"{path} is empty")
    # JSON goes as JSON; anything else (dynarl or RLinf YAML) as YAML text, so the server's errors
    # can point at a line and column.
    return data, "application/json" if path.lower().endswith(".json") else "application/yaml"


def cmd_submit(cli: Cli) -> int:
    body, content_type = read_spec(cli.args.file)
    headers = {"Idempotency-Key": cli.args.idempotency_key} if cli.args.idempotency_key else {}
    answer = cli.client().request(
        "POST", "/api/v1/jobs/", body=body, content_type=content_type, headers=headers
    )
    job = answer.json()
    if cli.as_json:
        cli.print_json(job)
        return EXIT_OK
    again = " (already submitted with this idempotency key)" if answer.status == 200 else ""
    cli.print(f"job {job['id']} {job['name']}: {job['state']} ({job['state_reason']}){again}")
    if job.get("state_detail"):
        cli.print(f"  {job['state_detail']}")
    return EXIT_OK


def job_row(job: dict[str, Any]) -> list[Any]:
    return [
        job["id"],
        job["name"],
        job["owner"],
        job["state"],
        job["state_reason"],
        job["policy"],
        f"{job.get('allocated_gpus', 0)}/{job['total_gpus']}",
        f"{job['iteration']}/{job['iterations_total']}",
        float(job["tokens_per_s"]),
        tables.when(job["submitted_at"]),
    ]


def cmd_jobs(cli: Cli) -> int:
    args = cli.args
    query = {
        "state": ",".join(args.state) if args.state else None,
        "owner": args.owner,
        "policy": args.policy,
        "name": args.name,
    }
    jobs = list(cli.client().paginate("/api/v1/jobs/", query, limit=args.limit))
    if cli.as_json:
        cli.print_json(jobs)
        return EXIT_OK
    headers = [
        "ID",
        "NAME",
        "OWNER",
        "STATE",
        "REASON",
        "POLICY",
        "GPUS",
        "ITER",
        "TOKENS/S",
        "SUBMITTED (UTC)",
    ]
    cli.print(tables.table(headers, [job_row(j) for j in jobs]) if jobs else "no jobs")
    return EXIT_OK


def cmd_job(cli: Cli) -> int:
    client = cli.client()
    job = client.get(f"/api/v1/jobs/{cli.args.id}/")
    if cli.as_json:
        cli.print_json(job)
        return EXIT_OK
    cli.print(f"job {job['id']}  {job['name']}")
    facts = [
        (
            "state",
            f"{job['state']} ({job['state_reason']})"
            + (f": {job['state_detail']}" if job["state_detail"] else ""),
        ),
        ("owner", job["owner"]),
        (
            "policy",
            f"{job['policy']}   backend {job['backend']}   priority {job['priority']}   format {job['spec_format']}",
        ),
        ("gpus", f"{job.get('allocated_gpus', 0)} allocated of {job['total_gpus']} asked"),
        (
            "progress",
            f"iteration {job['iteration']}/{job['iterations_total']}   {job['tokens_per_s']:.1f} tokens/s",
        ),
        ("submitted", tables.when(job["submitted_at"])),
        ("started", tables.when(job["started_at"])),
        ("finished", tables.when(job["finished_at"])),
    ]
    # The scheduler's latest word on the job: what its last tick did, and why nothing moved.
    for tick in client.paginate("/api/v1/ticks/", {"job": job["id"], "page_size": 1}, limit=1):
        facts.append(
            (
                "last tick",
                f"{tick['outcome']} at {tables.when(tick['started_at'])}"
                + (f": {tick['note']}" if tick["note"] else ""),
            )
        )
    for label, value in facts:
        cli.print(f"  {label:<10} {value}")
    groups = job.get("groups") or []
    if groups:
        cli.print("\ngroups")
        rows = []
        for g in groups:
            signals = g.get("signals") or {}
            rows.append(
                [
                    g["name"],
                    g["kind"],
                    g["gpus"],
                    len(g["workers"]),
                    tables.percent(signals.get("utilisation_mean")),
                    float(signals.get("tokens_per_s", 0.0)),
                    "yes: " + g["flag_reason"] if g["flagged"] else "",
                ]
            )
        cli.print(tables.table(["NAME", "KIND", "GPUS", "WORKERS", "UTIL", "TOKENS/S", "FLAGGED"], rows))
    transitions = job.get("transitions") or []
    if transitions:
        cli.print("\nhistory (UTC)")
        rows = [
            [
                tables.when(t["at"]),
                f"{t['from_state'] or '-'} -> {t['to_state']}",
                t["reason"],
                t["actor"],
                t["detail"],
            ]
            for t in transitions
        ]
        cli.print(tables.table(["AT", "STATE", "REASON", "BY", "DETAIL"], rows))
    return EXIT_OK


def cmd_cancel(cli: Cli) -> int:
    job = cli.client().post(f"/api/v1/jobs/{cli.args.id}/cancel/", {"detail": cli.args.reason})
    if cli.as_json:
        cli.print_json(job)
    else:
        cli.print(f"job {job['id']} {job['name']}: {job['state']} ({job['state_reason']})")
    return EXIT_OK


def migration_query(args: argparse.Namespace) -> dict[str, Any]:
    return {"job": args.job, "state": ",".join(args.state) if args.state else None}


def cmd_migrations(cli: Cli) -> int:
    args = cli.args
    client = cli.client()
    if args.csv:
        client.download(EXPORTS["migrations"], _binary(cli.out), {**migration_query(args), "format": "csv"})
        return EXIT_OK
    migrations = list(client.paginate("/api/v1/migrations/", migration_query(args), limit=args.limit))
    if cli.as_json:
        cli.print_json(migrations)
        return EXIT_OK
    rows = [
        [
            m["migration_id"],
            m["job"],
            m["state"],
            m["strategy"],
            f"{m['donor'] or '-'} -> {m['recipient'] or '-'}",
            len(m["device_uids"]),
            len(m["steps"]),
            "-" if m["duration_s"] is None else f"{m['duration_s']:.1f}s",
            tables.when(m["created_at"]),
            m["requested_by"],
        ]
        for m in migrations
    ]
    headers = [
        "MIGRATION",
        "JOB",
        "STATE",
        "STRATEGY",
        "MOVE",
        "GPUS",
        "STEPS",
        "TOOK",
        "CREATED (UTC)",
        "BY",
    ]
    cli.print(tables.table(headers, rows) if rows else "no migrations")
    return EXIT_OK


def cmd_export(cli: Cli) -> int:
    args = cli.args
    query: dict[str, Any] = {"format": args.format, "job": args.job}
    if args.what == "migrations":
        query["rows"] = args.rows
    elif args.rows != "migration":
        raise UsageError("--rows applies to 'export migrations' only")
    client = cli.client()
    if args.output in (None, "-"):
        client.download(EXPORTS[args.what], _binary(cli.out), query)
        return EXIT_OK
    target = Path(args.output)
    try:
        with target.open("wb") as sink:
            written = client.download(EXPORTS[args.what], sink, query)
    except OSError as exc:
        raise UsageError(f"cannot write {target}: {exc.strerror or exc}") from exc
    cli.err.write(f"wrote {written} bytes to {target}\n")
    return EXIT_OK


def cmd_nodes(cli: Cli) -> int:
    query = {"status": ",".join(cli.args.status) if cli.args.status else None}
    nodes = list(cli.client().paginate("/api/v1/nodes/", query))
    if cli.as_json:
        cli.print_json(nodes)
        return EXIT_OK
    rows = [
        [
            n["name"],
            n["status"],
            # The job backends admission places here by (older servers send only `backend`).
            ",".join(n.get("backends") or [n["backend"]]),
            n["hardware"],
            n["devices_total"],
            n["devices_free"],
            n["devices_allocated"],
            n["devices_lost"],
            tables.percent(n["utilisation_mean"]),
            tables.ago(n["last_heartbeat_at"]),
        ]
        for n in nodes
    ]
    headers = [
        "NAME",
        "STATUS",
        "BACKEND",
        "HARDWARE",
        "GPUS",
        "FREE",
        "ALLOCATED",
        "LOST",
        "UTIL",
        "HEARTBEAT",
    ]
    cli.print(tables.table(headers, rows) if rows else "no nodes")
    return EXIT_OK


class _TextSink:
    """Bytes from the API written to a text stream that has no binary buffer (e.g. a StringIO)."""

    def __init__(self, out: TextIO) -> None:
        self.out = out

    def write(self, data: bytes) -> int:
        self.out.write(data.decode("utf-8"))
        return len(data)


def _binary(out: TextIO) -> Any:
    buffer = getattr(out, "buffer", None)
    if buffer is not None:
        out.flush()
        return buffer
    return _TextSink(out)


# --- the parser --------------------------------------------------------------------------------


def _states(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(value: str) -> list[str]:
        states = [s.strip() for s in value.split(",") if s.strip()]
        unknown = [s for s in states if s not in allowed]
        if unknown or not states:
            raise argparse.ArgumentTypeError(f"{value!r}: choose from {', '.join(allowed)}")
        return states

    return parse


def _flatten(values: list[list[str]] | None) -> list[str]:
    return [v for group in values or [] for v in group]


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: a flag given after the command must not be reset by the command's own default.
    common.add_argument("--url", default=argparse.SUPPRESS, help="server URL (env DYNARL_URL)")
    common.add_argument("--token", default=argparse.SUPPRESS, help="API token (env DYNARL_TOKEN)")
    common.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="print JSON for machines"
    )

    parser = argparse.ArgumentParser(
        prog="dynarl",
        description="Submit, watch and steer RL post-training jobs on a dynarl control plane.",
        epilog="Exit codes: 0 ok, 1 API error (or server unreachable), 2 usage. See docs/cli.md.",
        parents=[common],
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, handler: Callable[[Cli], int], help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, parents=[common], help=help_text, description=help_text)
        sub.set_defaults(handler=handler)
        return sub

    login = command("login", cmd_login, "get an API token and save it in the config file")
    login.add_argument("--username", help="asked for when absent")
    login.add_argument("--password-stdin", action="store_true", help="read the password from stdin")
    login.add_argument("--with-token", action="store_true", help="save a token read from stdin instead")
    login.add_argument(
        "--login-path", default=LOGIN_PATH, help=f"the server's login form (default {LOGIN_PATH})"
    )
    login.add_argument(
        "--token-name", default=f"dynarl-cli@{socket.gethostname()}", help="name of the new token"
    )

    submit = command("submit", cmd_submit, "submit a job spec (dynarl YAML/JSON or RLinf YAML; - for stdin)")
    submit.add_argument("file")
    submit.add_argument("--idempotency-key", help="repeat safely: the same key and spec return the same job")

    jobs = command("jobs", cmd_jobs, "list jobs, newest first")
    jobs.add_argument("--state", type=_states(JOB_STATES), action="append", help="e.g. running,pending")
    jobs.add_argument("--owner", help="owner's username")
    jobs.add_argument("--policy")
    jobs.add_argument("--name", help="name contains")
    jobs.add_argument("--limit", type=int, default=50, help="at most this many (0: all; default 50)")

    job = command("job", cmd_job, "show one job: state, history, groups and their GPUs")
    job.add_argument("id", type=int)

    cancel = command("cancel", cmd_cancel, "cancel a job and stop its workers")
    cancel.add_argument("id", type=int)
    cancel.add_argument("--reason", default="", help="kept with the transition and the audit trail")

    migrations = command("migrations", cmd_migrations, "list migrations (GPU moves), newest first")
    migrations.add_argument("--job", type=int, help="only this job's")
    migrations.add_argument("--state", type=_states(MIGRATION_STATES), action="append")
    migrations.add_argument("--csv", action="store_true", help="print every match as CSV (the export)")
    migrations.add_argument("--limit", type=int, default=50, help="at most this many (0: all; default 50)")

    export = command("export", cmd_export, "stream every migration or audit event as CSV or JSON")
    export.add_argument("what", choices=sorted(EXPORTS))
    export.add_argument("--format", choices=["csv", "json"], default="csv")
    export.add_argument("--job", type=int, help="only this job's")
    export.add_argument(
        "--rows", choices=["migration", "step"], default="migration", help="migrations: one row per"
    )
    export.add_argument("-o", "--output", help="write to this file (default: stdout)")

    nodes = command("nodes", cmd_nodes, "list GPU nodes with their devices and heartbeat")
    nodes.add_argument("--status", type=_states(NODE_STATUSES), action="append")
    return parser


def print_error(cli: Cli, error: ApiError) -> None:
    if cli.as_json:
        body = {
            "error": {
                "status": error.status,
                "code": error.code,
                "message": error.message,
                "fields": [{"path": f.path, "message": f.message} for f in error.fields],
                "request_id": error.request_id,
            }
        }
        cli.err.write(json.dumps(body) + "\n")
        return
    cli.err.write(f"error: {error.message}\n")
    for problem in error.fields:
        shown = _problem_line(problem)
        if shown not in error.message or len(error.fields) > 1:
            cli.err.write(f"  {shown}\n")
    if error.request_id:
        cli.err.write(f"  (request id {error.request_id})\n")


def _problem_line(problem: FieldProblem) -> str:
    return f"{problem.path}: {problem.message}" if problem.path else problem.message


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    args = build_parser().parse_args(argv)  # exits 2 on a usage error, 0 on --help
    for name in ("state", "status"):
        if hasattr(args, name):
            setattr(args, name, _flatten(getattr(args, name)))
    cli = Cli(args, out or sys.stdout, err or sys.stderr)
    try:
        code: int = args.handler(cli)
        return code
    except ApiError as exc:
        print_error(cli, exc)
        return EXIT_API_ERROR
    except Unreachable as exc:
        cli.err.write(f"error: {exc}\n")
        return EXIT_API_ERROR
    except UsageError as exc:
        cli.err.write(f"dynarl: {exc}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        cli.err.write("interrupted\n")
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
