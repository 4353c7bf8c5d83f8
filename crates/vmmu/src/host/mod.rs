//! The host side of guest memory: backing sources and the memory behind them.

pub mod anon;
pub mod backing;
pub mod lru;
pub mod memory;
