//! One job shared by several threads, when the process may not be allowed to start them all.

/// Runs `work` on the calling thread and on up to `threads - 1` more. A thread the process may
/// not start (its thread limit: a container's pids limit, `ulimit -u`) is left out, never a
/// panic: the work goes to the threads that started, the caller's always among them, so
/// `work` must take its share from a common source (a counter of items) until none is left.
/// Returns each thread's result, the caller's first.
pub(crate) fn on_threads<T: Send, F: Fn() -> T + Sync>(threads: usize, work: F) -> Vec<T> {
    std::thread::scope(|scope| {
        let helpers: Vec<_> = (1..threads)
            .map_while(|_| std::thread::Builder::new().spawn_scoped(scope, &work).ok())
            .collect();
        let mut results = vec![work()];
        results.extend(
            helpers
                .into_iter()
                .map(|h| h.join().expect("a worker thread does not panic")),
        );
        results
    })
}
