//! The host side of guest memory: backing sources and the memory behind them.

pub mod anon;
pub mod backing;
pub mod lru;
pub mod memory;

/// Why the host could not do what was asked of its memory.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HostError {
    /// The allocator refused the memory behind a region (or its size overflows).
    #[error("the host cannot reserve {bytes} bytes of guest memory")]
    CannotReserve {
        /// How many bytes were asked for.
        bytes: u64,
    },
    /// A region keeps one word of each page or all of them.
    #[error("a region keeps 1 or {full} words per page, not {asked}")]
    WordsPerPage {
        /// Words in a full page.
        full: u64,
        /// What was asked.
        asked: u64,
    },
    /// A memslot larger than a region's PFN bits cover.
    #[error("a memslot of {pages} pages is larger than the {max} pages a region holds")]
    RegionTooLarge {
        /// Pages asked for.
        pages: u64,
        /// Pages a region holds.
        max: u64,
    },
    /// Every region is taken.
    #[error("no more than {max} memslots can be backed")]
    NoRegionLeft {
        /// Regions a memslot can have.
        max: usize,
    },
    /// A `-s` that names no backing source.
    #[error("unknown backing source '{0}': use one of {names}", names = crate::host::backing::Backing::names())]
    UnknownBacking(String),
    /// A `--lru` that names no policy.
    #[error("unknown LRU policy '{0}' (use classic or mglru)")]
    UnknownLruPolicy(String),
}

/// The one-line message, for the layers whose errors are still strings.
impl From<HostError> for String {
    fn from(e: HostError) -> String {
        e.to_string()
    }
}
