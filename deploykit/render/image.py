"""The engine image's build context (Dockerfile, entrypoint, build.sh) and the files every container target mounts
(plan.json, the seccomp profiles, nginx.conf).
"""

from __future__ import annotations

from .. import __version__
from ..plan import Plan
from . import nginx, seccomp
from .container import PLAN_PATH, healthcheck, model_mount
from .output import File
from .templating import template

# nginx: every Docker deployment's load balancer runs from this image (the only container publishing a port).
RUNTIME_PACKAGES = ("libtcmalloc-minimal4", "libnuma1", "numactl", "nginx")
SBOM_PATH = "/opt/deploykit/sbom.cdx.json"  # in the image; build.sh and `up` copy it next to the rendered files
SBOM_FILE = "sbom.cdx.json"
# Not deploykit.deployment: containers inherit image labels, and any container run from this image would then
# count as one of the deployment's (and be removed by its `down`). The intermediate stages carry it too, so `up`
# can find and drop a superseded build's stage images (the builder stage alone is about 2 GB).
BUILT_FOR_LABEL = "deploykit.image-built-for"


def image_files(plan: Plan) -> list[File]:
    """The build context every container target shares, plus the files the containers mount."""
    offline = plan.image.wheelhouse is not None
    uid = plan.security.run_as_user
    base, _, digest = plan.image.base.partition("@")
    labels = (("org.opencontainers.image.title", plan.image.name),
              ("org.opencontainers.image.description", f"deploykit CPU inference engine for deployment {plan.name}"),
              ("org.opencontainers.image.version", plan.image.tag),
              ("org.opencontainers.image.licenses", "Apache-2.0"),
              ("org.opencontainers.image.base.name", base),
              *((("org.opencontainers.image.base.digest", digest),) if digest else ()),
              ("io.deploykit.version", __version__),
              ("io.deploykit.sbom", SBOM_PATH))
    ctx = dict(plan=plan, offline=offline, uid=uid, packages=RUNTIME_PACKAGES, labels=labels,
               requirement=f"deploykit[engine]=={__version__}", sbom_requirement=f"deploykit[sbom]=={__version__}",
               built_for=BUILT_FOR_LABEL, sbom_path=SBOM_PATH, healthcheck=list(healthcheck(plan.serving.port)))
    files = [
        File("Dockerfile", template("Dockerfile.j2", **ctx).encode()),
        File(".dockerignore", template("dockerignore.j2").encode()),
        File("entrypoint.sh", template("entrypoint.sh.j2", plan=plan, model_dir=model_mount(plan).target,
                                       plan_path=PLAN_PATH).encode(), 0o755),
        File("build.sh", template("build.sh.j2", plan=plan, offline=offline, sbom_path=SBOM_PATH,
                                  sbom_file=SBOM_FILE).encode(), 0o755),
        File("plan.json", plan.to_json().encode()),
    ]
    profile = seccomp.profile(plan.security.seccomp)
    if profile is not None:
        files.append(File("seccomp.json", seccomp.dumps(profile)))
        # x86-64: the plan's ISA vocabulary (avx512*, amx*) only describes x86 hosts.
        files.append(File("seccomp-oci.json", seccomp.dumps(seccomp.flatten_for_oci(profile, arch="x86_64"))))
    files.append(nginx.file(plan))
    return files
