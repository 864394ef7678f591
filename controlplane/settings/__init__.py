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
  LOG_LEVEL        default INFO
"""

from __future__ import annotations

from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from controlplane.settings.env import env_bool, env_float, env_list, env_optional, env_str

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
    "channels",
    "controlplane",
    "jobs",
    "scheduler",
    "agents",
    "frontend",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "controlplane.audit.RequestIdMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
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
            ],
        },
    },
]

DATABASES = {
    "default": dj_database_url.parse(
        env_str("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/dynarl"),
        conn_max_age=60,
        conn_health_checks=True,
    )
}
if DATABASES["default"]["ENGINE"] != "django.db.backends.postgresql":
    raise ImproperlyConfigured("DATABASE_URL must point at PostgreSQL")

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
STATIC_ROOT = Path(env_str("STATIC_ROOT", str(DATA_DIR / "static")))
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"},
}
# Serve straight from the apps' static folders when nothing was collected (development, tests).
WHITENOISE_USE_FINDERS = DEBUG
if DEBUG:
    STORAGES["staticfiles"] = {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"}

LOGIN_URL = "/admin/login/"

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
}
# /healthz reports beat as late when its last mark is older than this many seconds.
BEAT_STALE_AFTER_S = env_float("BEAT_STALE_AFTER_S", 30.0)

# --- The scheduling loop ------------------------------------------------------------------------
SIGNAL_WINDOW_S = env_float("SIGNAL_WINDOW_S", 10.0)  # sliding window the policies read
SNAPSHOT_EVERY_S = env_float("SNAPSHOT_EVERY_S", 30.0)  # a snapshot at least this often, and on change
PREDICTOR_SETTLE_S = env_float("PREDICTOR_SETTLE_S", 20.0)  # wait before comparing prediction and outcome
STEP_TIMEOUT_MIN_S = env_float("STEP_TIMEOUT_MIN_S", 60.0)  # a silent step fails after this long ...
STEP_TIMEOUT_FACTOR = env_float("STEP_TIMEOUT_FACTOR", 10.0)  # ... or this many times its estimate
TICK_SCHEDULE_S = env_float("TICK_SCHEDULE_S", 1.0)  # beat fans out ticks this often

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {"hosts": [REDIS_URL]},
    }
}

# --- REST ---------------------------------------------------------------------------------------
REST_FRAMEWORK = {
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
}
SPECTACULAR_SETTINGS = {
    "TITLE": "dynarl API",
    "DESCRIPTION": "Submit, watch and steer RL post-training jobs; audit every GPU move.",
    "VERSION": "1",
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
}

if not DEBUG:
    SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", False)
    CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", False)
