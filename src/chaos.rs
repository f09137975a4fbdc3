//! Race harness (work in progress).
