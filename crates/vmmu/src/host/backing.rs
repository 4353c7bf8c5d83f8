//! Backing sources for guest memory, named as KVM selftests name them (`-s`), and the largest
//! mapping level each allows (KVM's `host_pfn_mapping_level()` reads this off the host page
//! tables; here the backing source states it).

use crate::host::HostError;
use crate::units::{PageSize, PAGE_SIZE};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Where guest memory comes from on the host. Reports name each as the selftests' `-s` does.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Backing {
    /// Anonymous memory in 4 KiB pages: every mapping is 4K.
    #[serde(rename = "anonymous")]
    Anonymous,
    /// Anonymous memory with transparent huge pages: mappings up to 2M.
    #[serde(rename = "anonymous_thp")]
    AnonymousThp,
    /// hugetlbfs with 2 MiB pages.
    #[serde(rename = "anonymous_hugetlb_2mb")]
    AnonymousHugetlb2mb,
    /// hugetlbfs with 1 GiB pages.
    #[serde(rename = "anonymous_hugetlb_1gb")]
    AnonymousHugetlb1gb,
}

impl Backing {
    /// hugetlbfs: the VMA's own page size is huge (KVM/arm64 maps with it rather than through
    /// `transparent_hugepage_adjust()`).
    pub fn is_hugetlb(self) -> bool {
        matches!(
            self,
            Backing::AnonymousHugetlb2mb | Backing::AnonymousHugetlb1gb
        )
    }

    /// Every backing source, in the order `--help` lists them.
    pub const ALL: [Backing; 4] = [
        Backing::Anonymous,
        Backing::AnonymousThp,
        Backing::AnonymousHugetlb2mb,
        Backing::AnonymousHugetlb1gb,
    ];

    /// The selftest name (`-s` value).
    pub fn name(self) -> &'static str {
        match self {
            Backing::Anonymous => "anonymous",
            Backing::AnonymousThp => "anonymous_thp",
            Backing::AnonymousHugetlb2mb => "anonymous_hugetlb_2mb",
            Backing::AnonymousHugetlb1gb => "anonymous_hugetlb_1gb",
        }
    }

    /// The host page size: the largest page KVM may map over this memory.
    pub fn max_page_size(self) -> PageSize {
        match self {
            Backing::Anonymous => PageSize::Size4K,
            Backing::AnonymousThp | Backing::AnonymousHugetlb2mb => PageSize::Size2M,
            Backing::AnonymousHugetlb1gb => PageSize::Size1G,
        }
    }

    /// The host page size in bytes (selftests' `get_backing_src_pagesz()`).
    pub fn page_size(self) -> u64 {
        self.max_page_size().pages() * PAGE_SIZE
    }

    /// The selftests' other `-s` names, each modelled as one of the sources above: the model
    /// maps shared memory as it maps private memory (only the page size bounds a mapping),
    /// `anonymous_hugetlb` is the default huge page size (2 MiB with 4 KiB base pages), and
    /// `shmem` without `huge=` is mapped in 4 KiB pages.
    pub const ALIASES: &'static [(&'static str, Backing)] = &[
        ("anonymous_hugetlb", Backing::AnonymousHugetlb2mb),
        ("shared_thp", Backing::AnonymousThp),
        ("shared_hugetlb", Backing::AnonymousHugetlb2mb),
        ("shmem", Backing::Anonymous),
    ];

    /// All names, comma separated, for error messages.
    pub fn names() -> String {
        Backing::ALL
            .iter()
            .map(|b| b.name())
            .chain(Backing::ALIASES.iter().map(|(n, _)| *n))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl fmt::Display for Backing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Backing {
    type Err = HostError;
    fn from_str(s: &str) -> Result<Self, HostError> {
        Backing::ALL
            .iter()
            .copied()
            .find(|b| b.name() == s)
            .or_else(|| {
                Backing::ALIASES
                    .iter()
                    .find(|(n, _)| *n == s)
                    .map(|(_, b)| *b)
            })
            .ok_or_else(|| HostError::UnknownBacking(s.into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_are_rejected() {
        for b in Backing::ALL {
            assert_eq!(b.name().parse::<Backing>().unwrap(), b);
        }
        assert_eq!("shmem".parse::<Backing>().unwrap(), Backing::Anonymous);
        assert_eq!(
            "anonymous_hugetlb".parse::<Backing>().unwrap(),
            Backing::AnonymousHugetlb2mb
        );
        let err = "shared_hugetlb_16kb".parse::<Backing>().unwrap_err();
        assert!(
            err.to_string().contains("anonymous_hugetlb_1gb") && err.to_string().contains("shmem"),
            "{err}"
        );
    }
}
