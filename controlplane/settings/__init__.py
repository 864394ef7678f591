"""dynarl settings. One module for every environment: a deployment differs only by its env vars.

Variables (all optional unless noted):
  DATABASE_URL     PostgreSQL, e.g. postgres://user:pass@host:5432/dynarl
  REDIS_URL        Redis for the Celery broker and the Channels layer; redis://host:6379/0 or
                   unix:///path/to/redis.sock
  SECRET_KEY       required when DEBUG is off
  DEBUG            0/1 (default 0)
  ALLOWED_HOSTS    comma-separated (default: localhost,127.0.0.1,[::1])
  CSRF_TRUSTED_ORIGINS  comma-separated origins behind a proxy
  DYNARL_DATA_DIR  where the embedded default keeps its data (default: ./.dynarl)
  STATIC_ROOT      where collectstatic writes (default: $DYNARL_DATA_DIR/static)
  CELERY_WORKER_PING_TIMEOUT  seconds /healthz waits for workers to answer (default 1.0)
  DYNARL_SUPERVISOR_STATUS_FILE  set by the run command for its processes: the file in which its
                   supervisor keeps their states, which /healthz then reports (unset: no such check)
  LOG_LEVEL        default INFO
  METRICS_TOKEN    when set, /metrics requires "Authorization: Bearer <METRICS_TOKEN>"
  METRICS_ALLOWED_IPS  comma-separated addresses/CIDRs /metrics answers (default: loopback only,
                   127.0.0.0/8 and ::1, when METRICS_TOKEN is unset; any address when it is set);
                   both apply when both are set
  JOB_SPEC_MAX_BYTES    largest job-spec submission body, YAML or JSON (default 1048576); over it, 413
  JOB_SPEC_MAX_DEPTH    deepest nesting of a spec document (default 64)
  JOB_SPEC_MAX_NODES    most values (keys, items, scalars; YAML aliases counted expanded) (default 20000)
  JOB_SPEC_MAX_ALIASES  most YAML alias uses in a spec (default 200)
  ALERT_*          anomaly alert thresholds (see the Monitoring block below)

Database connections (each process keeps its own pool; see README "Database connections"):
  DB_POOL_MAX_SIZE connections one process may hold at once (default 10); 0 turns pooling off
                   (a connection per request or task, for an external pooler such as PgBouncer)
  DB_POOL_MIN_SIZE connections a process keeps open while idle (default 0)
  DB_POOL_TIMEOUT_S  seconds a request or task waits for a free connection (default 10); then an
                   HTTP request is answered 503 with Retry-After and a tick is retried
  DB_BUSY_RETRY_AFTER_S  the Retry-After (seconds) of those 503s, and the delay before a
                   scheduling tick that found the database busy runs again (default 5)

Serving behind TLS and proxies (see README "Deploying behind TLS"):
  TRUSTED_PROXIES  comma-separated addresses/CIDRs of reverse proxies whose X-Forwarded-For and
                   X-Forwarded-Proto are believed (default: none, so a client cannot spoof its
                   address or scheme); the client address then is the first untrusted hop
  DYNARL_TLS       0/1: served over HTTPS (by daphne itself or a trusted proxy); turns on HSTS and
                   Secure session and CSRF cookies (default 0)
  SECURE_HSTS_SECONDS  the HSTS max-age sent on HTTPS responses (default 31536000 with
                   DYNARL_TLS=1, else 0 = no HSTS)
  SESSION_COOKIE_SECURE, CSRF_COOKIE_SECURE  0/1, override what DYNARL_TLS implies
  CSP_REPORT_ONLY  0/1: send the Content-Security-Policy as Report-Only (default 0: enforced)
  CSP_REPORT_URI   where browsers report violations (default: none)

Login throttling (django-axes; the dashboard's and the admin's login forms):
  LOGIN_THROTTLE   0/1 (default 1)
  LOGIN_FAILURE_LIMIT  failed sign-ins in a row, per username and client address, before that
                   pair is locked out (default 5)
  LOGIN_COOLOFF_S  seconds a lockout lasts (default 900); 0 = until an admin resets it
                   (python manage.py axes_reset_username <name>, or the admin's Access attempts)
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import dj_database_url
from csp.constants import NONCE, NONE, REPORT_SAMPLE, SELF
from django.core.exceptions import ImproperlyConfigured

from controlplane.settings.env import (
    env_bool,
    env_float,
    env_int,
    env_list,
    env_networks,
    env_optional,
    env_str,
)

BASE_DIR = Path(__file__).resolve().parent.parent.parent
DATA_DIR = Path(env_str("DYNARL_DATA_DIR", str(BASE_DIR / ".dynarl")))

DEBUG = env_bool("DEBUG", False)
_secret = env_optional("SECRET_KEY")
if _secret is None:
    if not DEBUG:
        raise ImproperlyConfigured("SECRET_KEY must be set when DEBUG is off")
    _secret = "insecure-development-key-set-SECRET_KEY-in-production"
SECRET_KEY = _secret

ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "channels",
    "csp",
    "axes",
    "common",
    "cluster",
    "controlplane",
    "jobs",
    "scheduler",
    "agents",
    "frontend",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "csp.middleware.CSPMiddleware",
    "common.audit.RequestIdMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "common.overload.DatabaseBusyMiddleware",
    # Last, as django-axes asks: it turns a refused sign-in into the lockout page.
    "axes.middleware.AxesMiddleware",
]
AUTHENTICATION_BACKENDS = [
    # First: refuses a locked-out username/address pair before any password is checked.
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]

ROOT_URLCONF = "controlplane.urls"
ASGI_APPLICATION = "controlplane.asgi.application"
WSGI_APPLICATION = "controlplane.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "frontend.context.role",
            ],
        },
    },
]

# --- PostgreSQL: one connection pool per process ---------------------------------------------
# Under ASGI every concurrent sync request runs in its own thread, hence wants its own connection;
# the pool caps what one process holds (DB_POOL_MAX_SIZE) and makes the rest wait (at most
# DB_POOL_TIMEOUT_S, then 503). Pooling excludes persistent connections (CONN_MAX_AGE=0): a
# request or task hands its connection back to the pool when it ends.
DB_POOL_MAX_SIZE = env_int("DB_POOL_MAX_SIZE", 10)
DB_POOL_MIN_SIZE = env_int("DB_POOL_MIN_SIZE", 0)
DB_POOL_TIMEOUT_S = env_float("DB_POOL_TIMEOUT_S", 10.0)
DB_BUSY_RETRY_AFTER_S = env_int("DB_BUSY_RETRY_AFTER_S", 5)
if DB_POOL_MAX_SIZE < 0:
    raise ImproperlyConfigured("DB_POOL_MAX_SIZE must be 0 (no pool) or more")
if not 0 <= DB_POOL_MIN_SIZE <= DB_POOL_MAX_SIZE:
    raise ImproperlyConfigured("DB_POOL_MIN_SIZE must be between 0 and DB_POOL_MAX_SIZE")
if DB_POOL_TIMEOUT_S <= 0 or DB_BUSY_RETRY_AFTER_S < 1:
    raise ImproperlyConfigured("DB_POOL_TIMEOUT_S must be positive and DB_BUSY_RETRY_AFTER_S at least 1")
DATABASES = {
    "default": dj_database_url.parse(
        env_str("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/dynarl"),
        conn_max_age=0,
        conn_health_checks=True,
    )
}
if DATABASES["default"]["ENGINE"] != "django.db.backends.postgresql":
    raise ImproperlyConfigured("DATABASE_URL must point at PostgreSQL")
if DB_POOL_MAX_SIZE > 0:
    DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
        "min_size": DB_POOL_MIN_SIZE,
        "max_size": DB_POOL_MAX_SIZE,
        "timeout": DB_POOL_TIMEOUT_S,
    }

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_FINDERS = [
    "django.contrib.staticfiles.finders.FileSystemFinder",
    "django.contrib.staticfiles.finders.AppDirectoriesFinder",
    "frontend.finders.PlotlyFinder",  # plotly.js from the plotly package, no CDN
]
STATIC_ROOT = Path(env_str("STATIC_ROOT", str(DATA_DIR / "static")))
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"},
}
# Serve straight from the apps' static folders when nothing was collected (development, tests);
# deployments run collectstatic and get hashed, compressed files.
# Hashed names need the manifest that collectstatic writes, so they are used once it exists (or
# while collectstatic itself runs, to write it).
_manifest_ready = (STATIC_ROOT / "staticfiles.json").exists() or "collectstatic" in sys.argv
WHITENOISE_USE_FINDERS = DEBUG or not _manifest_ready
if WHITENOISE_USE_FINDERS:
    STORAGES["staticfiles"] = {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"}

LOGIN_URL = "/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/login/"

# --- Redis: Celery broker and Channels layer -------------------------------------------------
REDIS_URL = env_str("REDIS_URL", "redis://127.0.0.1:6379/0")


def _celery_broker_url(redis_url: str) -> str:
    # kombu spells a Unix-socket Redis as redis+socket:///path; redis-py as unix:///path.
    if redis_url.startswith("unix://"):
        return "redis+socket://" + redis_url.removeprefix("unix://")
    return redis_url


CELERY_BROKER_URL = _celery_broker_url(REDIS_URL)
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ACKS_LATE = True  # a worker killed mid-task leaves the message to be redelivered
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TIMEZONE = "UTC"
CELERY_BEAT_SCHEDULE_FILENAME = str(DATA_DIR / "celerybeat-schedule")
CELERY_WORKER_PING_TIMEOUT = env_float("CELERY_WORKER_PING_TIMEOUT", 1.0)
CELERY_BEAT_SCHEDULE = {
    "record-beat": {"task": "controlplane.tasks.record_beat", "schedule": 5.0},
    "schedule-ticks": {
        "task": "scheduler.tasks.schedule_ticks",
        "schedule": env_float("TICK_SCHEDULE_S", 1.0),
        "options": {"expires": 5.0},
    },
    "detect-lost-nodes": {
        "task": "agents.tasks.detect_lost_nodes",
        "schedule": env_float("NODE_LIVENESS_CHECK_S", 5.0),
        "options": {"expires": 10.0},
    },
    "prune-telemetry": {
        "task": "agents.tasks.prune_telemetry",
        "schedule": 600.0,
        "options": {"expires": 300.0},
    },
    "detect-anomalies": {
        "task": "scheduler.tasks_alerts.detect_anomalies",
        "schedule": env_float("ALERT_CHECK_S", 5.0),
        "options": {"expires": 30.0},
    },
    "publish-telemetry-rollups": {
        "task": "scheduler.tasks_alerts.publish_telemetry_rollups",
        "schedule": env_float("TELEMETRY_ROLLUP_S", 2.0),
        "options": {"expires": 10.0},
    },
}
# Task modules autodiscovery (which only finds <app>/tasks.py) would miss.
CELERY_IMPORTS = ("scheduler.tasks_alerts",)
# /healthz reports beat as late when its last mark is older than this many seconds.
BEAT_STALE_AFTER_S = env_float("BEAT_STALE_AFTER_S", 30.0)
# Under the run command, /healthz also reports the supervised processes' states from this file.
SUPERVISOR_STATUS_FILE = env_optional("DYNARL_SUPERVISOR_STATUS_FILE")

# --- The scheduling loop ------------------------------------------------------------------------
SIGNAL_WINDOW_S = env_float("SIGNAL_WINDOW_S", 10.0)  # sliding window the policies read
SNAPSHOT_EVERY_S = env_float("SNAPSHOT_EVERY_S", 30.0)  # a snapshot at least this often, and on change
PREDICTOR_SETTLE_S = env_float("PREDICTOR_SETTLE_S", 20.0)  # wait before comparing prediction and outcome
STEP_TIMEOUT_MIN_S = env_float("STEP_TIMEOUT_MIN_S", 60.0)  # a silent step fails after this long ...
STEP_TIMEOUT_FACTOR = env_float("STEP_TIMEOUT_FACTOR", 10.0)  # ... or this many times its estimate
PLACEMENT_CHANGE_TIMEOUT_S = env_float("PLACEMENT_CHANGE_TIMEOUT_S", 300.0)  # a job re-placement that has not
# finished after this long fails the job (its workers neither stopped nor started)
TICK_SCHEDULE_S = env_float("TICK_SCHEDULE_S", 1.0)  # beat fans out ticks this often

# --- Node agents and telemetry ------------------------------------------------------------------
NODE_LOST_AFTER_S = env_float("NODE_LOST_AFTER_S", 30.0)  # a node silent this long is marked lost
NODE_LIVENESS_CHECK_S = env_float("NODE_LIVENESS_CHECK_S", 5.0)  # beat looks for lost nodes this often
AGENT_HEARTBEAT_INTERVAL_S = env_float("AGENT_HEARTBEAT_INTERVAL_S", 1.0)  # told to agents at register
AGENT_COMMAND_REDELIVER_S = env_float("AGENT_COMMAND_REDELIVER_S", 30.0)  # unanswered commands go out again
AGENT_POLL_FALLBACK_S = env_float("AGENT_POLL_FALLBACK_S", 5.0)  # long-polls recheck the database this often
AGENT_DB_THREADS = env_int("AGENT_DB_THREADS", 4)  # threads (and DB connections) serving agent requests
# Largest agent request body: a step report may carry every request a rollout handed over (MBs).
AGENT_MAX_BODY_BYTES = env_int("AGENT_MAX_BODY_BYTES", 64 * 1024 * 1024)
TELEMETRY_BUCKET_S = env_float("TELEMETRY_BUCKET_S", 10.0)  # one TelemetrySample row per worker per bucket
TELEMETRY_RETENTION_HOURS = env_float("TELEMETRY_RETENTION_HOURS", 72.0)  # older rows are deleted
TELEMETRY_LIVE_WINDOW_S = env_float("TELEMETRY_LIVE_WINDOW_S", 120.0)  # raw samples kept in Redis per job
TELEMETRY_LIVE_MAX_SAMPLES = env_int("TELEMETRY_LIVE_MAX_SAMPLES", 200_000)  # hard cap per job in Redis

# --- Job specs: bounds checked while a submitted spec is read, before anything else -----------
# (jobs.spec.DocumentLimits; docs/job-spec.md#limits). The body limit is the same for every content
# type and is answered 413; the others are a 400 naming the limit.
JOB_SPEC_MAX_BYTES = env_int("JOB_SPEC_MAX_BYTES", 1024 * 1024)
JOB_SPEC_MAX_DEPTH = env_int("JOB_SPEC_MAX_DEPTH", 64)
JOB_SPEC_MAX_NODES = env_int("JOB_SPEC_MAX_NODES", 20_000)
JOB_SPEC_MAX_ALIASES = env_int("JOB_SPEC_MAX_ALIASES", 200)
if min(JOB_SPEC_MAX_BYTES, JOB_SPEC_MAX_DEPTH, JOB_SPEC_MAX_NODES) < 1 or JOB_SPEC_MAX_ALIASES < 0:
    raise ImproperlyConfigured(
        "JOB_SPEC_MAX_BYTES, JOB_SPEC_MAX_DEPTH and JOB_SPEC_MAX_NODES must be at least 1, "
        "JOB_SPEC_MAX_ALIASES at least 0"
    )

# --- Monitoring: /metrics and anomaly alerts ------------------------------------------------------
METRICS_TOKEN = env_optional("METRICS_TOKEN")  # when set, /metrics wants "Authorization: Bearer <it>"
# Without a token, only this machine may scrape; with one, any address that presents it ([] = any).
_metrics_default_ips = [] if METRICS_TOKEN else ["127.0.0.0/8", "::1"]
METRICS_ALLOWED_IPS = env_networks("METRICS_ALLOWED_IPS", _metrics_default_ips) or _metrics_default_ips
ALERT_CHECK_S = env_float("ALERT_CHECK_S", 5.0)  # beat looks for anomalies this often
ALERT_STUCK_WINDOW_S = env_float("ALERT_STUCK_WINDOW_S", 60.0)  # a worker idle this long while ...
ALERT_STUCK_UTILISATION = env_float("ALERT_STUCK_UTILISATION", 0.02)  # ... at or under this ("~zero") ...
ALERT_GROUP_BUSY_UTILISATION = env_float("ALERT_GROUP_BUSY_UTILISATION", 0.5)  # ... its group averages this
ALERT_COLLAPSE_WINDOW_S = env_float("ALERT_COLLAPSE_WINDOW_S", 60.0)  # throughput judged over this window
ALERT_COLLAPSE_HISTORY_S = env_float("ALERT_COLLAPSE_HISTORY_S", 600.0)  # recent median taken over this
ALERT_COLLAPSE_FRACTION = env_float("ALERT_COLLAPSE_FRACTION", 0.2)  # raised under this share of the median
ALERT_RECOVERED_FRACTION = env_float("ALERT_RECOVERED_FRACTION", 0.5)  # cleared at or over this share
# A node silent this long raises an alert; it must stay under NODE_LOST_AFTER_S to come first.
ALERT_HEARTBEAT_GAP_S = env_float("ALERT_HEARTBEAT_GAP_S", min(10.0, NODE_LOST_AFTER_S / 3))
TELEMETRY_ROLLUP_S = env_float("TELEMETRY_ROLLUP_S", 2.0)  # live telemetry roll-ups go out this often
if ALERT_HEARTBEAT_GAP_S >= NODE_LOST_AFTER_S:
    raise ImproperlyConfigured("ALERT_HEARTBEAT_GAP_S must be shorter than NODE_LOST_AFTER_S")

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {"hosts": [REDIS_URL]},
    }
}

# --- REST ---------------------------------------------------------------------------------------
REST_FRAMEWORK = {
    "DEFAULT_SCHEMA_CLASS": "common.api.schema.ApiAutoSchema",
    # Bearer first: its WWW-Authenticate header makes requests without credentials answer 401.
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "common.api.authentication.ApiTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["common.api.permissions.ViewerReadOperatorWrite"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.JSONParser"],
    "DEFAULT_FILTER_BACKENDS": ["django_filters.rest_framework.DjangoFilterBackend"],
    "DEFAULT_PAGINATION_CLASS": "common.api.pagination.PagePagination",
    "EXCEPTION_HANDLER": "controlplane.api.errors.exception_handler",
    "DATETIME_FORMAT": "iso-8601",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "dynarl API",
    "DESCRIPTION": (
        "Submit, watch and steer RL post-training jobs; audit every GPU move.\n\n"
        "Authenticate with `Authorization: Bearer <token>` (create one at `POST /api/v1/tokens/`) or "
        "a browser session. Roles: viewer (read), operator (submit and steer jobs), admin (also "
        "everyone's tokens). Every 4xx/5xx answers one shape, an `error` object with `status`, "
        "`code`, `message`, `fields` (each path at fault) and `request_id`. Every response carries "
        "`X-Request-ID`, "
        "which is also written on the audit events the request caused."
    ),
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    # Swagger UI from the installed sidecar package: clusters often have no internet access.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    "SCHEMA_PATH_PREFIX": r"/api/v1",
    "ENUM_NAME_OVERRIDES": {
        "JobStateEnum": "jobs.models.JobState",
        "JobReasonEnum": "jobs.models.JobReason",
        "WorkerStateEnum": "jobs.models.WorkerState",
        "MigrationStateEnum": "scheduler.models.MigrationState",
        "StepStateEnum": "scheduler.models.StepState",
        "PredictorScopeEnum": "scheduler.models.PredictorScope",
        "AlertKindEnum": "scheduler.models.AlertKind",
        "NodeStatusEnum": "cluster.models.NodeStatus",
        "DeviceStatusEnum": "cluster.models.DeviceStatus",
        "ActorTypeEnum": "common.models.ActorType",
    },
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
}

# --- Serving: proxies, TLS, Content-Security-Policy ---------------------------------------------
# X-Forwarded-For/-Proto are applied to the ASGI scope (controlplane.asgi) only when the peer is
# one of these; everything downstream (REMOTE_ADDR, request.is_secure(), login throttling, the
# /metrics allow-list) then sees the real client. No SECURE_PROXY_SSL_HEADER for that reason: it
# would believe the header from anyone.
TRUSTED_PROXIES = env_networks("TRUSTED_PROXIES", [])
DYNARL_TLS = env_bool("DYNARL_TLS", False)
# HSTS goes out on HTTPS responses only (SecurityMiddleware), so it never locks out a plain-HTTP dev run.
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 31_536_000 if DYNARL_TLS else 0)
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", DYNARL_TLS)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", DYNARL_TLS)

# Scripts and styles from this server only. Plotly adds its global CSS rules to a <style> element
# it finds by id; the pages provide that element with this response's nonce, so no
# 'unsafe-inline' is needed. Inline style attributes are set through CSSOM (allowed) by the JS.
# Refused (and reported once per chart page): the map library's stylesheet that plotly's full
# bundle writes at load, used only by map traces, which the dashboard does not draw.
_csp_directives: dict[str, list[Any]] = {
    "default-src": [SELF],
    "script-src": [SELF, REPORT_SAMPLE],
    "style-src": [SELF, NONCE, REPORT_SAMPLE],
    "img-src": [SELF, "data:"],
    "font-src": [SELF],
    "connect-src": [SELF],  # the REST API and the WebSockets of this origin
    "object-src": [NONE],
    "base-uri": [NONE],
    "form-action": [SELF],
    "frame-ancestors": [NONE],
}
_csp_report_uri = env_optional("CSP_REPORT_URI")
if _csp_report_uri:
    _csp_directives["report-uri"] = [_csp_report_uri]
_csp_policy = {"DIRECTIVES": _csp_directives}
if env_bool("CSP_REPORT_ONLY", False):
    CONTENT_SECURITY_POLICY_REPORT_ONLY = _csp_policy
else:
    CONTENT_SECURITY_POLICY = _csp_policy

# --- Login throttling (django-axes) ----------------------------------------------------------------
AXES_ENABLED = env_bool("LOGIN_THROTTLE", True)
AXES_FAILURE_LIMIT = env_int("LOGIN_FAILURE_LIMIT", 5)
_cooloff_s = env_float("LOGIN_COOLOFF_S", 900.0)
AXES_COOLOFF_TIME = timedelta(seconds=_cooloff_s) if _cooloff_s > 0 else None
# A username from one address: a stranger cannot lock the admin out from elsewhere, and one
# address cannot guess at one account for ever.
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_VERBOSE = False  # no start-up banner in every process; lockouts are logged anyway
AXES_CLIENT_IP_CALLABLE = "common.net.client_ip"
AXES_LOCKOUT_CALLABLE = "frontend.views.locked_out"
if AXES_FAILURE_LIMIT < 1:
    raise ImproperlyConfigured("LOGIN_FAILURE_LIMIT must be at least 1")
