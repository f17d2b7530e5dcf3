"""The engine image's templates (Dockerfile, entrypoint, build.sh), installed as the package `deploykit.images`."""
