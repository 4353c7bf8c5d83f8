//! Sweeps: many independent runs of a scenario (vCPU counts, the sides of a comparison), run
//! side by side where the engine allows, with results in the points' order.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

/// Runs `run` on every point and returns the results in the points' order. Virtual-time points
/// are independent and deterministic, so up to `jobs` of them run at once, heaviest first
/// (`weight`), and the output is a serial run's. `label` names a point in progress lines. The
/// first error stops handing out points and is returned.
pub fn run_points<P: Sync, R: Send, E: Send>(
    points: &[P],
    jobs: usize,
    weight: impl Fn(&P) -> u64,
    label: impl Fn(&P) -> String + Sync,
    progress: bool,
    run: impl Fn(&P) -> Result<R, E> + Sync,
) -> Result<Vec<R>, E> {
    let workers = jobs.max(1);
    let mut order: Vec<usize> = (0..points.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(weight(&points[i])));
    let next = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let results: Vec<std::sync::Mutex<Option<Result<R, E>>>> =
        (0..points.len()).map(|_| Default::default()).collect();
    std::thread::scope(|scope| {
        for _ in 0..workers.min(points.len()) {
            scope.spawn(|| loop {
                let k = next.fetch_add(1, Relaxed);
                let Some(&i) = order.get(k) else { break };
                let r = run(&points[i]);
                let failed = r.is_err();
                *results[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
                let d = done.fetch_add(1, Relaxed) + 1;
                if progress && points.len() > 1 {
                    eprintln!("vmmu: done {d}/{}: {}", points.len(), label(&points[i]));
                }
                if failed {
                    next.store(order.len(), Relaxed);
                }
            });
        }
    });
    let mut out = Vec::new();
    for r in results {
        match r.into_inner().unwrap_or_else(|e| e.into_inner()) {
            Some(Ok(r)) => out.push(r),
            Some(Err(e)) => return Err(e),
            // Not run because another point failed first.
            None => {}
        }
    }
    Ok(out)
}
