//! The redis server (to be written).
