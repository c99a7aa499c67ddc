//! distlock backend for etcd (work in progress).
