//! distlock backend for redis (work in progress).
