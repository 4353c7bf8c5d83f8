//! The soak's configuration generator: a random, valid, small command line for every
//! subcommand, over every switch that changes what the model does (architecture, MMU flavour,
//! lock regime, backing, engine, each technique on and off, the workload's shape), each drawn
//! from its own seed so a configuration does not depend on which others ran.

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

/// The subcommands the soak runs, in the order its summary lists them.
pub const SUBCOMMANDS: [&str; 6] = [
    "dirty-log",
    "page-table",
    "reclaim",
    "access-tracking",
    "nested-churn",
    "migrate",
];

/// One generated run: the subcommand and its arguments (without `--quiet`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// The subcommand (one of [`SUBCOMMANDS`]).
    pub subcommand: &'static str,
    /// Its arguments.
    pub args: Vec<String>,
    /// The engine it runs on (`threads` or `virtual`).
    pub engine: &'static str,
}

impl Config {
    /// The command line that reproduces the run.
    pub fn command_line(&self) -> String {
        let mut s = format!("vmmu {}", self.subcommand);
        for a in &self.args {
            s.push(' ');
            s.push_str(a);
        }
        s
    }
}

/// The size multipliers a run draws from (see [`config`]'s `max_scale`).
pub const SCALES: [u64; 4] = [1, 2, 4, 8];

/// The configuration of run `index` of a soak seeded with `seed`, its sizes multiplied by at
/// most `max_scale` (one of [`SCALES`]).
pub fn config(seed: u64, index: u64, max_scale: u64) -> Config {
    // SplitMix64's increment spreads consecutive indexes over the seed space.
    let mut rng = StdRng::seed_from_u64(seed ^ index.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let subcommand = *SUBCOMMANDS.choose(&mut rng).expect("not empty");
    let mut g = Gen {
        rng: &mut rng,
        args: Vec::new(),
        huge_guest_pages: false,
        scale: 1,
    };
    g.scale = g.pick(&[1, 1, 1, 1, 1, 1, 2, 2, 4, 8]).min(max_scale);
    let engine = g.pick(&["threads", "virtual"]);
    match subcommand {
        "dirty-log" => g.dirty_log(engine),
        "page-table" => g.page_table(engine),
        "reclaim" => g.reclaim(engine),
        "access-tracking" => g.access_tracking(engine),
        "nested-churn" => g.nested_churn(engine),
        _ => g.migrate(engine),
    }
    g.flag("--engine", engine);
    // The report's form: the selftest's text, JSON, or text without counters.
    match g.pick(&["", "", "", "--json", "--no-counters"]) {
        "" => {}
        form => g.switch(form),
    }
    Config {
        subcommand,
        args: g.args,
        engine,
    }
}

/// The machine a run models, as far as the generator needs to know it.
#[derive(Copy, Clone, PartialEq, Eq)]
enum Machine {
    /// x86 with EPT: the TDP MMU.
    Tdp,
    /// x86 with EPT: the shadow MMU (direct).
    ShadowEpt,
    /// x86 without EPT: shadow paging.
    ShadowPaging,
    /// arm64 stage 2.
    Arm64,
}

struct Gen<'r> {
    rng: &'r mut StdRng,
    args: Vec<String>,
    /// Shadow paging with 2 MiB guest pages: each memslot holds whole 2 MiB pages.
    huge_guest_pages: bool,
    /// Sizes are multiplied by this: 1 for most runs, up to 8 for some, so contended and
    /// long-running regimes (a dozen vCPUs, tens of MiB each) are reached too.
    scale: u64,
}

impl Gen<'_> {
    fn pick<T: Copy>(&mut self, from: &[T]) -> T {
        *from.choose(self.rng).expect("not empty")
    }

    fn coin(&mut self, p: f64) -> bool {
        self.rng.gen_bool(p)
    }

    fn flag(&mut self, name: &str, value: impl ToString) {
        self.args.push(name.to_string());
        self.args.push(value.to_string());
    }

    fn switch(&mut self, name: &str) {
        self.args.push(name.to_string());
    }

    fn on_off(&mut self, name: &str) {
        let v = self.pick(&["on", "off"]);
        self.flag(name, v);
    }

    /// `--arch arm64` in one of its three lock regimes.
    fn arm64_lock(&mut self) {
        self.flag("--arch", "arm64");
        let lock = self.pick(&["spin", "perm-fast-path", "parallel"]);
        self.flag("--arm64-lock", lock);
    }

    /// A technique of `m` that `--compare` can run both sides of in dirty-log, page-table and
    /// migrate. Not `arm64-lock`: its sides include seed 001's v2 regime, whose race the
    /// invariants are meant to catch wherever vCPUs meet on a block (the generator leaves v2
    /// out for the same reason in [`Gen::arm64_lock`]).
    fn machine_technique(&mut self, m: Machine) -> &'static str {
        match m {
            Machine::Arm64 => self.pick(&["eager-split", "tlbi-range"]),
            Machine::ShadowPaging => "eager-split",
            _ => self.pick(&["eager-split", "pml"]),
        }
    }

    /// `--arch`, `--mmu` and `--arm64-lock`: what reclaim and access-tracking accept.
    fn mmu(&mut self) -> Machine {
        match self.pick(&[Machine::Tdp, Machine::ShadowEpt, Machine::Arm64]) {
            Machine::Arm64 => {
                self.arm64_lock();
                Machine::Arm64
            }
            Machine::ShadowEpt => {
                self.flag("--mmu", "shadow");
                Machine::ShadowEpt
            }
            m => m,
        }
    }

    /// Every machine switch of dirty-log, page-table and migrate.
    fn machine(&mut self) -> Machine {
        let m = self.pick(&[
            Machine::Tdp,
            Machine::ShadowEpt,
            Machine::ShadowPaging,
            Machine::Arm64,
        ]);
        match m {
            Machine::Arm64 => {
                self.arm64_lock();
                let mode = self.pick(&[2, 3, 4, 5, 5, 5, 6, 7, 11, 12, 13, 14]);
                self.flag("-m", mode);
                self.on_off("--tlbi-range");
                self.on_off("--fwb");
                let relax = self.pick(&["broadcast", "local"]);
                self.flag("--relax-flush", relax);
                if self.coin(0.5) {
                    self.flag("--eager-split", "on");
                    let chunk = self.pick(&["4K", "2M", "1G"]);
                    self.flag("--split-chunk", chunk);
                } else {
                    self.flag("--eager-split", "off");
                }
            }
            Machine::Tdp | Machine::ShadowEpt => {
                if m == Machine::ShadowEpt {
                    self.flag("--mmu", "shadow");
                } else {
                    let alloc = self.pick(&["nowait-first", "drop-lock"]);
                    self.flag("--tdp-split-alloc", alloc);
                }
                self.on_off("--pml");
                self.on_off("--eager-split");
            }
            Machine::ShadowPaging => {
                self.flag("--mmu", "shadow");
                self.flag("--ept", "off");
                let size = self.pick(&["4k", "2m"]);
                self.flag("--guest-page-size", size);
                self.huge_guest_pages = size == "2m";
                self.on_off("--eager-split");
            }
        }
        let preempt = self.pick(&["full", "full", "none"]);
        self.flag("--host-preempt", preempt);
        m
    }

    fn backing(&mut self) {
        let s = self.pick(&[
            "anonymous",
            "anonymous_thp",
            "anonymous_hugetlb_2mb",
            "anonymous_hugetlb_1gb",
        ]);
        self.flag("-s", s);
    }

    fn dirty_log(&mut self, engine: &str) {
        let m = self.machine();
        self.backing();
        let sweep = engine == "virtual" && self.coin(0.15);
        if sweep {
            let list = self.pick(&["1,2", "1,3", "2,4", "1,2,4"]);
            self.flag("--vcpus", list);
            let jobs = self.pick(&[1, 2]);
            self.flag("--jobs", jobs);
        } else {
            let v = self.rng.gen_range(1..=4 + 2 * self.scale);
            self.flag("-v", v);
        }
        let b = if self.huge_guest_pages {
            self.pick(&[2u64, 4, 8])
        } else {
            self.pick(&[1u64, 2, 4, 8])
        };
        self.flag("-b", format!("{}M", b * self.scale));
        let i = self.rng.gen_range(1..=4);
        self.flag("-i", i);
        let w = self.pick(&[0, 10, 50, 65, 100, 100]);
        self.flag("-w", w);
        // Slots divide guest memory evenly (into whole 2 MiB guest pages).
        let x = if self.huge_guest_pages {
            1
        } else {
            self.pick(&[1, 1, 2, 4])
        };
        self.flag("-x", x);
        let r = self.rng.gen_range(1..=1000);
        self.flag("-r", r);
        for s in ["-g", "-a", "-o", "-e"] {
            if self.coin(0.35) {
                self.switch(s);
            }
        }
        if engine == "virtual" && !sweep && self.coin(0.2) {
            let compare = self.machine_technique(m);
            self.compare(compare);
        }
    }

    /// `--compare FEATURE`, with the switch it compares taken out of the arguments.
    fn compare(&mut self, feature: &str) {
        let drop: &[&str] = match feature {
            "eager-split" => &["--eager-split", "--split-chunk"],
            "arm64-lock" => &["--arm64-lock"],
            "tlbi-range" => &["--tlbi-range"],
            "pml" => &["--pml"],
            "aging" => &["--lru", "--aging"],
            "zap-orphans" => &["--zap-orphans"],
            _ => &[],
        };
        let mut kept = Vec::new();
        let mut it = std::mem::take(&mut self.args).into_iter();
        while let Some(a) = it.next() {
            if a == "--auto-converge" && feature == "auto-converge" {
                continue;
            }
            if drop.contains(&a.as_str()) {
                it.next();
            } else {
                kept.push(a);
            }
        }
        self.args = kept;
        self.flag("--compare", feature);
    }

    fn page_table(&mut self, engine: &str) {
        let m = self.machine();
        self.backing();
        let v = self.rng.gen_range(1..=4);
        self.flag("-v", v);
        let b = self.pick(&["1M", "2M", "4M", "8M", "2M,4M"]);
        self.flag("-b", b);
        if self.coin(0.4) {
            let n = self.pick(&[1, 8, 64]);
            self.flag("--backward-pages", n);
        }
        if engine == "virtual" && self.coin(0.2) {
            let compare = self.machine_technique(m);
            self.compare(compare);
        }
    }

    fn reclaim(&mut self, engine: &str) {
        self.mmu();
        let c = self.rng.gen_range(1..=4 + self.scale);
        self.flag("-c", c);
        let slot_mib = self.pick(&[16u64, 32, 64]) * self.scale;
        let slots = self.pick(&[1u64, 1, 2, 3]);
        self.flag("-m", format!("{}M", slot_mib * slots));
        self.flag("-s", format!("{slot_mib}M"));
        // A host with half to all of the memfd: kswapd works at every size.
        let host = slot_mib * self.pick(&[50u64, 62, 75, 90, 100]) / 100;
        self.flag("--host-memory", format!("{}M", host.max(16)));
        let lru = self.pick(&["classic", "mglru"]);
        self.flag("--lru", lru);
        let aging = self.pick(&["locked", "lockless"]);
        self.flag("--aging", aging);
        if engine == "virtual" && self.coin(0.15) {
            self.compare("aging");
        }
    }

    /// 4K anonymous memory only: page_idle on huge folios is not modelled.
    fn access_tracking(&mut self, engine: &str) {
        self.mmu();
        let v = self.rng.gen_range(1..=2 + 2 * self.scale);
        self.flag("-v", v);
        let b = self.pick(&[1u64, 2, 4]) * self.scale;
        self.flag("-b", format!("{b}M"));
        if self.coin(0.3) {
            self.switch("-o");
        }
        let aging = self.pick(&["locked", "lockless"]);
        self.flag("--aging", aging);
        if engine == "virtual" && self.coin(0.15) {
            self.compare("aging");
        }
    }

    fn nested_churn(&mut self, engine: &str) {
        // L1 has whole GiBs; small L2s keep the run short.
        self.flag("--l1-memory", "1G");
        let l2 = self.pick(&[2u64, 4, 8, 16]);
        self.flag("--l2-memory", format!("{l2}M"));
        let concurrent = self.rng.gen_range(1..=6);
        self.flag("--concurrent", concurrent);
        let rounds = self.rng.gen_range(1..=3);
        self.flag("--rounds", rounds);
        let vcpus = self.rng.gen_range(1..=3);
        self.flag("--l1-vcpus", vcpus);
        let quantum = self.pick(&[64, 256, 512]);
        self.flag("--quantum", quantum);
        if self.coin(0.2) {
            let pages = self.pick(&[64, 256, 1024]);
            self.flag("--mmu-pages", pages);
        }
        let zap = self.pick(&["on", "v1", "off"]);
        self.flag("--zap-orphans", zap);
        let slot_zap = self.pick(&["all-fast", "memslot"]);
        self.flag("--slot-zap", slot_zap);
        let teardown = self.pick(&["top-down", "bottom-up"]);
        self.flag("--teardown", teardown);
        let alloc = self.pick(&["random", "lifo"]);
        self.flag("--l1-alloc", alloc);
        self.on_off("--ept-ad");
        let seed = self.rng.gen_range(1..=1000);
        self.flag("--seed", seed);
        if engine == "virtual" && self.coin(0.15) {
            self.compare("zap-orphans");
        }
    }

    fn migrate(&mut self, engine: &str) {
        let m = self.machine();
        self.backing();
        let v = self.rng.gen_range(1..=2 + self.scale);
        self.flag("-v", v);
        let b_mib = self.pick(&[2u64, 4, 8]) * self.scale.min(4);
        self.flag("-b", format!("{b_mib}M"));
        if self.coin(0.5) {
            let ws = self.pick(&[1u64, 2]).min(b_mib);
            self.flag("--working-set", format!("{ws}M"));
        }
        let w = self.pick(&[50, 100]);
        self.flag("-w", w);
        let think = self.pick(&[200, 500, 1000]);
        self.flag("--think-ns", think);
        for s in ["-a", "-g"] {
            if self.coin(0.3) {
                self.switch(s);
            }
        }
        let x = if self.huge_guest_pages {
            1
        } else {
            self.pick(&[1, 2])
        };
        self.flag("-x", x);
        // A link that sends guest memory in 50 ms at most: each round's guest time is then
        // a few hundred thousand accesses a vCPU, whatever the size.
        let bytes = (v * b_mib) << 20;
        let least_gbit = (bytes * 8 * 20).div_ceil(1 << 30);
        let gbit = self.pick(&[1u64, 2, 10]).max(least_gbit);
        self.flag("--bandwidth", format!("{gbit}Gbit"));
        let rounds = self.rng.gen_range(1..=4);
        self.flag("--max-rounds", rounds);
        self.flag("--bucket", "5ms");
        self.flag("--warmup", "10ms");
        if self.coin(0.2) {
            self.switch("--auto-converge");
        }
        let manual = !self.args.iter().any(|a| a == "-g");
        // The dirty ring is modelled with EPT (shadow paging's guest table syncs have no ring).
        if matches!(m, Machine::Tdp | Machine::ShadowEpt) && engine == "virtual" && self.coin(0.2) {
            let ring = self.pick(&[256, 1024]);
            self.flag("--dirty-ring", ring);
        } else if manual && self.coin(0.3) {
            let shift = self.pick(&[6, 12, 18, 31]);
            self.flag("--clear-bitmap-shift", shift);
        }
        if engine == "virtual" && self.coin(0.15) {
            // Migrate's own techniques besides the machine's: the dirty ring (which needs
            // --dirty-ring) and auto-converge.
            let compare = if self.args.iter().any(|a| a == "--dirty-ring") {
                "dirty-ring"
            } else if m != Machine::Arm64 && self.coin(0.3) {
                "auto-converge"
            } else {
                self.machine_technique(m)
            };
            self.compare(compare);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_s_configuration_depends_only_on_the_seed_and_its_index() {
        assert_eq!(config(7, 3, 8), config(7, 3, 8));
        let all: Vec<Config> = (0..64).map(|i| config(7, i, 8)).collect();
        for s in SUBCOMMANDS {
            assert!(all.iter().any(|c| c.subcommand == s), "{s} is generated");
        }
        assert!(all.iter().any(|c| c.engine == "threads"));
        assert!(all.iter().any(|c| c.engine == "virtual"));
        assert_ne!(config(7, 3, 8), config(8, 3, 8));
    }
}
