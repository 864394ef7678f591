from django.contrib.auth import views as auth_views
from django.urls import path

from frontend import views

app_name = "frontend"

urlpatterns = [
    path("", views.home, name="home"),
    path("jobs/", views.jobs, name="jobs"),
    path("jobs/spec-lines/", views.spec_lines, name="spec-lines"),
    path("jobs/<int:job_id>/", views.job, name="job"),
    path("audit/", views.audit, name="audit"),
    path("login/", auth_views.LoginView.as_view(template_name="frontend/login.html"), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
]
