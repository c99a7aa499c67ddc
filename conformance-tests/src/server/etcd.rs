//! The etcd server (to be written).
