//! The postgres server (to be written).
