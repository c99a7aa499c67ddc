"""The PEP 517 build backend: maturin's, but a build without a Rust
toolchain stops with a message saying what to do, instead of letting maturin
download a toolchain (about 1.1 GB) into a cache directory, or fail offline
with a download error."""

import os
import shutil

# maturin installs Rust through puccinialin unless this is set.
os.environ.setdefault("MATURIN_NO_INSTALL_RUST", "1")

import maturin  # noqa: E402

_NO_TOOLCHAIN = """\
distlock-rs: building from source needs the Rust toolchain (cargo and rustc 1.88 or newer) \
on PATH, and protoc for the etcd backend (Debian/Ubuntu: apt-get install protobuf-compiler), \
and compiles about 250 crates (minutes). cargo is not on PATH, so nothing was built or downloaded.
Install a prebuilt wheel instead (pip install distlock-rs, or a wheel built by \
scripts/build-wheels), or install Rust (https://rustup.rs) and retry."""


def _require_cargo():
    if shutil.which("cargo") is None:
        raise SystemExit(_NO_TOOLCHAIN)


def get_requires_for_build_wheel(config_settings=None):
    _require_cargo()
    return maturin.get_requires_for_build_wheel(config_settings)


def get_requires_for_build_editable(config_settings=None):
    _require_cargo()
    return maturin.get_requires_for_build_wheel(config_settings)


def get_requires_for_build_sdist(config_settings=None):
    _require_cargo()
    return maturin.get_requires_for_build_sdist(config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _require_cargo()
    return maturin.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    _require_cargo()
    return maturin.build_editable(wheel_directory, config_settings, metadata_directory)


def build_sdist(sdist_directory, config_settings=None):
    _require_cargo()
    return maturin.build_sdist(sdist_directory, config_settings)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    _require_cargo()
    return maturin.prepare_metadata_for_build_wheel(metadata_directory, config_settings)
