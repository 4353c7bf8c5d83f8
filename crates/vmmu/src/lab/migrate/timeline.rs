//! Each vCPU's progress per time bucket, from samples of the guests' access counters.

/// Each vCPU's accesses per bucket, from samples of their counters: what happened between two
/// samples is spread over the buckets the interval covers, in proportion to the overlap (the
/// migration thread samples after every send batch, so an interval spans more than one bucket
/// only around a long ioctl).
#[derive(Clone, Debug, Default)]
pub(super) struct Timeline {
    bucket_ns: u64,
    last_t: u64,
    last: Vec<u64>,
    /// `[bucket][vcpu]`.
    buckets: Vec<Vec<u64>>,
}

impl Timeline {
    pub(super) fn new(bucket_ns: u64, vcpus: usize) -> Self {
        Timeline {
            bucket_ns,
            last_t: 0,
            last: vec![0; vcpus],
            buckets: Vec::new(),
        }
    }

    pub(super) fn bucket(&mut self, b: usize) -> &mut Vec<u64> {
        let n = self.last.len();
        if self.buckets.len() <= b {
            self.buckets.resize_with(b + 1, || vec![0; n]);
        }
        &mut self.buckets[b]
    }

    /// The timeline starts (t = 0) with the counters at `now` (what populating memory did
    /// is not on it).
    pub(super) fn start(&mut self, now: &[u64]) {
        self.last.copy_from_slice(now);
        self.last_t = 0;
    }

    /// Each vCPU's accesses per bucket (`[vcpu][bucket]`).
    pub(super) fn per_vcpu(&self) -> Vec<Vec<u64>> {
        (0..self.last.len())
            .map(|v| self.buckets.iter().map(|b| b[v]).collect())
            .collect()
    }

    /// The counters were `now` at time `t` (ns since the workload started).
    pub(super) fn sample(&mut self, t: u64, now: &[u64]) {
        let (t0, w) = (self.last_t, self.bucket_ns);
        for (v, &count) in now.iter().enumerate() {
            let delta = count - self.last[v];
            if delta == 0 {
                continue;
            }
            let first = (t0 / w) as usize;
            let last = (t.saturating_sub(1).max(t0) / w) as usize;
            if first == last || t <= t0 {
                self.bucket(first)[v] += delta;
                continue;
            }
            let mut given = 0;
            for b in first..=last {
                let lo = t0.max(b as u64 * w);
                let hi = t.min((b as u64 + 1) * w);
                let share = if b == last {
                    delta - given
                } else {
                    (delta as u128 * (hi - lo) as u128 / (t - t0) as u128) as u64
                };
                given += share;
                self.bucket(b)[v] += share;
            }
        }
        self.last.copy_from_slice(now);
        self.last_t = t;
    }

    /// Buckets up to the one that ends at or after `t`, each summed over the vCPUs.
    pub(super) fn totals(&self) -> Vec<u64> {
        self.buckets.iter().map(|b| b.iter().sum()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sample_spreads_over_the_buckets_it_covers() {
        let mut t = Timeline::new(100, 1);
        t.sample(50, &[10]);
        t.sample(350, &[40]);
        // 30 accesses over 50..350: 50 of it in bucket 0, 100 in 1 and 2, 50 in 3.
        assert_eq!(t.totals(), vec![15, 10, 10, 5]);
        t.sample(350, &[41]);
        assert_eq!(t.totals(), vec![15, 10, 10, 6]);
    }
}
