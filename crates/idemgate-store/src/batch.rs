//! Write batching: many claims (or completions), one statement, one commit.
//!
//! A claim must be durable before its request is forwarded, and a
//! completion before its client is answered — but neither has to commit
//! alone. Jobs queue on a bounded channel and a dispatcher hands whatever
//! has queued to the next free writer. There is no timer and no added wait:
//! at low load every batch holds one job and runs at once; under load, jobs
//! that arrive while the writer is busy share the next statement and its
//! commit (the same idea as a database's group commit, one level up; on
//! SQLite, whose one connection writes everything in turn, claims and
//! completions share one batcher and so one commit — `tiered.rs`). Every
//! caller gets its own answer only after the commit that made its write
//! durable.
//!
//! Every wait here is bounded by `store.timeout`, queueing included: a
//! caller that cannot be served in time gets [`StoreError::Timeout`], and
//! its job is dropped before it is written (a claim written after its
//! client was told 503 would hold the key for nothing). The queue is
//! bounded, so a hung database costs each waiter its timeout, not memory
//! that grows with the backlog. A job whose caller stopped waiting while its
//! batch was already being written may still commit: the batcher hands such
//! a job and its answer to an `orphaned` hook (a won claim nobody will
//! forward is released there). A batch that fails (other than by timing
//! out) is retried member by member, so one bad member (a key the database
//! refuses) never fails the others.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio::time::Instant;

use super::StoreError;

/// Jobs written together at most.
pub(crate) const MAX_BATCH: usize = 256;
/// Jobs waiting per batcher at most; a submit past it waits for room
/// (within its deadline).
pub(crate) const QUEUE_CAPACITY: usize = 4 * MAX_BATCH;
/// Batches in flight at once per batcher (each holds one pooled connection).
/// Few writers make big batches, and Postgres spends its CPU per statement
/// (`loadtest/README.md` has the measurements).
pub(crate) const WRITERS: usize = 1;

type Reply<R> = oneshot::Sender<Result<R, StoreError>>;

/// The longest rest a [`Lane`] takes after one batch, however long the
/// batch took (a write slowed by a busy store must not idle the lane for
/// seconds after it).
pub(crate) const MAX_REST: Duration = Duration::from_millis(100);

/// How a batcher's writes are shaped.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Lane {
    /// Jobs written together at most.
    pub max_batch: usize,
    /// After each batch written, the lane's writer rests this many times
    /// as long as the batch took (0: not at all; at most [`MAX_REST`]), so
    /// the lane's writes take at most 1 / (1 + `rest_per_write`) of its
    /// time (of writes shorter than `MAX_REST / rest_per_write`; a longer
    /// one is followed by `MAX_REST`) and work in other lanes finds the
    /// store free in between.
    pub rest_per_write: u32,
}

impl Default for Lane {
    fn default() -> Self {
        Lane {
            max_batch: MAX_BATCH,
            rest_per_write: 0,
        }
    }
}

/// One queued job: what to write, whom to answer, and until when the
/// answer is still wanted.
struct Job<J, R> {
    job: J,
    reply: Reply<R>,
    deadline: Instant,
}

/// A queue of jobs `J` answered with `R`.
pub(crate) struct Batcher<J, R> {
    queue: mpsc::Sender<Job<J, R>>,
    op: &'static str,
    timeout: Duration,
}

impl<J, R> Clone for Batcher<J, R> {
    fn clone(&self) -> Self {
        Batcher {
            queue: self.queue.clone(),
            op: self.op,
            timeout: self.timeout,
        }
    }
}

impl<J: Send + 'static, R: Send + 'static> Batcher<J, R> {
    /// Starts a dispatcher; `write` runs one batch, hands the jobs back and
    /// answers each, in order. `timeout` bounds every submit; `orphaned`
    /// gets each job written after its caller stopped waiting.
    pub(crate) fn spawn<W, F, O>(op: &'static str, timeout: Duration, write: W, orphaned: O) -> Self
    where
        W: Fn(Vec<J>) -> F + Send + Sync + 'static,
        F: Future<Output = (Vec<J>, Result<Vec<R>, StoreError>)> + Send + 'static,
        O: Fn(J, R) + Send + Sync + 'static,
    {
        Self::spawn_lane(op, timeout, Lane::default(), write, orphaned)
    }

    /// [`Self::spawn`], shaped by `lane`.
    pub(crate) fn spawn_lane<W, F, O>(
        op: &'static str,
        timeout: Duration,
        lane: Lane,
        write: W,
        orphaned: O,
    ) -> Self
    where
        W: Fn(Vec<J>) -> F + Send + Sync + 'static,
        F: Future<Output = (Vec<J>, Result<Vec<R>, StoreError>)> + Send + 'static,
        O: Fn(J, R) + Send + Sync + 'static,
    {
        let max_batch = lane.max_batch.clamp(1, MAX_BATCH);
        let rest = lane.rest_per_write;
        let (queue, mut jobs) = mpsc::channel::<Job<J, R>>(QUEUE_CAPACITY);
        let writers = Arc::new(Semaphore::new(WRITERS));
        let write = Arc::new(write);
        let orphaned = Arc::new(orphaned);
        tokio::spawn(async move {
            while let Some(first) = jobs.recv().await {
                // Wait for a free writer first: jobs that arrive meanwhile
                // join this batch.
                let Ok(writer) = writers.clone().acquire_owned().await else {
                    return;
                };
                let mut batch = Vec::with_capacity(8);
                let mut next = Some(first);
                while let Some(job) = next.take() {
                    if let Some(job) = still_wanted(job, op, timeout) {
                        batch.push(job);
                    }
                    if batch.len() < max_batch {
                        next = jobs.try_recv().ok();
                    }
                }
                if batch.is_empty() {
                    continue;
                }
                let (write, orphaned) = (write.clone(), orphaned.clone());
                tokio::spawn(async move {
                    let started = Instant::now();
                    let written = run_batch(&*write, &*orphaned, batch, op).await;
                    // Its callers are answered; the writer rests before
                    // the lane's next batch. Not after a failure: a
                    // timed-out write measures the outage, not the work.
                    if rest > 0 && written {
                        tokio::time::sleep((started.elapsed() * rest).min(MAX_REST)).await;
                    }
                    drop(writer);
                });
            }
        });
        Batcher { queue, op, timeout }
    }

    /// Submits one job; resolves after its batch committed, or with
    /// [`StoreError::Timeout`] once `store.timeout` has passed (queueing
    /// included).
    pub(crate) async fn submit(&self, job: J) -> Result<R, StoreError> {
        let deadline = Instant::now() + self.timeout;
        let stopped = || StoreError::Unavailable {
            op: self.op,
            cause: "the batch writer stopped".into(),
        };
        let (reply, mut answer) = oneshot::channel();
        let work = async {
            self.queue
                .send(Job {
                    job,
                    reply,
                    deadline,
                })
                .await
                .map_err(|_| stopped())?;
            (&mut answer).await.unwrap_or_else(|_| Err(stopped()))
        };
        match tokio::time::timeout_at(deadline, work).await {
            Ok(answer) => answer,
            Err(_) => {
                // An answer sent just as the wait ran out (the timer can win
                // even then) is still this caller's: taken, not dropped with
                // the channel — a won claim nobody would forward or release.
                // Closed first, so any later answer goes to the orphan hook.
                answer.close();
                answer.try_recv().unwrap_or(Err(StoreError::Timeout {
                    op: self.op,
                    after: self.timeout,
                }))
            }
        }
    }
}

/// The job, unless its caller has stopped waiting (deadline passed, or the
/// caller is gone): such a job is answered and dropped unwritten.
fn still_wanted<J, R>(job: Job<J, R>, op: &'static str, after: Duration) -> Option<Job<J, R>> {
    if job.reply.is_closed() {
        return None;
    }
    if Instant::now() >= job.deadline {
        let _ = job.reply.send(Err(StoreError::Timeout { op, after }));
        return None;
    }
    Some(job)
}

/// Writes one batch; if it fails as a whole (but not by timing out: a hung
/// database fails every member alike), writes each member still wanted
/// alone, so that only the members that fail by themselves get the error.
/// Whether the batch was written as a whole.
async fn run_batch<J, R, W, F, O>(
    write: &W,
    orphaned: &O,
    batch: Vec<Job<J, R>>,
    op: &'static str,
) -> bool
where
    W: Fn(Vec<J>) -> F,
    F: Future<Output = (Vec<J>, Result<Vec<R>, StoreError>)>,
    O: Fn(J, R),
{
    let mut jobs = Vec::with_capacity(batch.len());
    let mut waiting = Vec::with_capacity(batch.len());
    for Job {
        job,
        reply,
        deadline,
    } in batch
    {
        jobs.push(job);
        waiting.push((reply, deadline));
    }
    let single = jobs.len() == 1;
    let (jobs, result) = write(jobs).await;
    match result {
        Ok(answers) => {
            for ((job, (reply, _)), answer) in jobs.into_iter().zip(waiting).zip(answers) {
                answer_or_orphan(reply, job, answer, orphaned);
            }
            true
        }
        Err(e) if single || matches!(e, StoreError::Timeout { .. }) => {
            let cause = e.to_string();
            for (reply, _) in waiting {
                let _ = reply.send(Err(StoreError::Unavailable {
                    op,
                    cause: cause.clone(),
                }));
            }
            false
        }
        Err(e) => {
            tracing::warn!(op, jobs = jobs.len(), error = %e, layer = "store", "batch failed; writing its members one by one");
            for (job, (reply, deadline)) in jobs.into_iter().zip(waiting) {
                if reply.is_closed() || Instant::now() >= deadline {
                    continue;
                }
                let (mut job, answer) = write(vec![job]).await;
                match answer.map(|mut answers| answers.pop()) {
                    Ok(Some(answer)) => match job.pop() {
                        Some(job) => answer_or_orphan(reply, job, answer, orphaned),
                        None => drop(reply.send(Ok(answer))),
                    },
                    Ok(None) => drop(reply.send(Err(StoreError::Unavailable {
                        op,
                        cause: "the batch statement answered nothing".into(),
                    }))),
                    Err(e) => drop(reply.send(Err(e))),
                }
            }
            false
        }
    }
}

/// Answers the caller, or — when it stopped waiting — hands the committed
/// job to the orphan hook.
fn answer_or_orphan<J, R>(reply: Reply<R>, job: J, answer: R, orphaned: &impl Fn(J, R)) {
    if let Err(Ok(answer)) = reply.send(Ok(answer)) {
        orphaned(job, answer);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test(start_paused = true)]
    async fn a_failed_batch_fails_only_its_bad_member() {
        // Odd jobs are "bad": any batch containing one fails as a whole.
        let batches = Arc::new(AtomicUsize::new(0));
        let seen = batches.clone();
        let batcher = Batcher::spawn(
            "test",
            Duration::from_secs(2),
            move |jobs: Vec<u32>| {
                seen.fetch_add(1, Ordering::SeqCst);
                async move {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    let result = if jobs.iter().any(|j| j % 2 == 1) {
                        Err(StoreError::Unavailable {
                            op: "test",
                            cause: "bad member".into(),
                        })
                    } else {
                        Ok(jobs.iter().map(|j| j * 10).collect())
                    };
                    (jobs, result)
                }
            },
            |_, _| {},
        );
        let answers = futures_util::future::join_all((0..6u32).map(|i| {
            let b = batcher.clone();
            async move { b.submit(i).await }
        }))
        .await;
        for (i, answer) in answers.iter().enumerate() {
            match answer {
                Ok(v) => assert!(i % 2 == 0 && *v == i as u32 * 10, "job {i}: {v}"),
                Err(_) => assert_eq!(i % 2, 1, "good job {i} failed with the bad ones"),
            }
        }
        assert!(batches.load(Ordering::SeqCst) > 1);
    }

    /// A one-job lane resting `rest` times each write, whose write of job
    /// `j` takes `write(j).0` ms and succeeds when `write(j).1`; submits
    /// jobs 0, 1 and 2 at once. When each write started, and when each
    /// caller was answered (both from the start).
    async fn three_jobs_on_a_lane(
        rest: u32,
        write: fn(u32) -> (u64, bool),
    ) -> (Vec<Duration>, Vec<Duration>) {
        let started = Instant::now();
        let writes = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = writes.clone();
        let lane = Lane {
            max_batch: 1,
            rest_per_write: rest,
        };
        let batcher = Batcher::spawn_lane(
            "test",
            Duration::from_secs(5),
            lane,
            move |jobs: Vec<u32>| {
                seen.lock().unwrap().push(started.elapsed());
                let (took, ok) = write(jobs[0]);
                async move {
                    tokio::time::sleep(Duration::from_millis(took)).await;
                    let result = match ok {
                        true => Ok(vec![(); jobs.len()]),
                        false => Err(StoreError::Unavailable {
                            op: "test",
                            cause: "refused".into(),
                        }),
                    };
                    (jobs, result)
                }
            },
            |_, _| {},
        );
        let answered = futures_util::future::join_all((0..3u32).map(|i| {
            let b = batcher.clone();
            async move {
                let _ = b.submit(i).await;
                started.elapsed()
            }
        }))
        .await;
        let writes = writes.lock().unwrap().clone();
        (writes, answered)
    }

    #[tokio::test(start_paused = true)]
    async fn a_resting_lane_answers_at_once_and_leaves_the_store_free_as_long_as_it_wrote() {
        let (writes, answered) = three_jobs_on_a_lane(1, |_| (10, true)).await;
        let ms = Duration::from_millis;
        // One job per write, each write 10 ms, a 10 ms rest after each.
        assert_eq!(writes, [ms(0), ms(20), ms(40)]);
        // Each caller is answered when its own write is done, not after
        // the rest that follows it.
        assert_eq!(answered, [ms(10), ms(30), ms(50)]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_lane_rests_only_after_a_written_batch_and_never_past_the_cap() {
        // Job 0 fails after 10 ms; job 1 takes a whole second; job 2 is
        // quick.
        let (writes, _) = three_jobs_on_a_lane(3, |job| match job {
            0 => (10, false),
            1 => (1000, true),
            _ => (10, true),
        })
        .await;
        let ms = Duration::from_millis;
        // No rest after the failure; after the long write, the cap.
        assert_eq!(writes, [ms(0), ms(10), ms(1010) + MAX_REST]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_hung_writer_answers_every_waiter_within_the_timeout_and_drops_late_jobs() {
        let written = Arc::new(AtomicUsize::new(0));
        let count = written.clone();
        let orphans = Arc::new(AtomicUsize::new(0));
        let orphaned = orphans.clone();
        let batcher = Batcher::spawn(
            "test",
            Duration::from_secs(2),
            move |jobs: Vec<u32>| {
                let count = count.clone();
                async move {
                    // The first batch hangs for 10 s (a locked database).
                    tokio::time::sleep(Duration::from_secs(10)).await;
                    count.fetch_add(1, Ordering::SeqCst);
                    let n = jobs.len();
                    (jobs, Ok(vec![true; n]))
                }
            },
            move |_, _| {
                orphaned.fetch_add(1, Ordering::SeqCst);
            },
        );
        let started = Instant::now();
        let answers = futures_util::future::join_all((0..500u32).map(|i| {
            let b = batcher.clone();
            async move { b.submit(i).await }
        }))
        .await;
        for answer in &answers {
            assert!(
                matches!(answer, Err(StoreError::Timeout { .. })),
                "{answer:?}"
            );
        }
        assert_eq!(started.elapsed(), Duration::from_secs(2));
        // Let the hung batch finish: the jobs queued behind it are past
        // their deadline and are never written.
        tokio::time::sleep(Duration::from_secs(30)).await;
        assert_eq!(
            written.load(Ordering::SeqCst),
            1,
            "only the first batch was written"
        );
        // Its members committed after their callers gave up: each is handed
        // to the orphan hook (a won claim is released there).
        assert!(orphans.load(Ordering::SeqCst) >= 1);
    }
}
