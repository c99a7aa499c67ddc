//! distlock backend for postgres (work in progress).
