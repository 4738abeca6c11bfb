//! Write batching: many claims (or completions), one statement, one commit.
//!
//! A claim must be durable before its request is forwarded, and a
//! completion before its client is answered — but neither has to commit
//! alone. Jobs queue on a channel and a dispatcher hands whatever has queued
//! to the next free writer. There is no timer and no added wait: at low load
//! every batch holds one job and runs at once; under load, jobs that arrive
//! while the writers are busy share the next statement and its commit (the
//! same idea as a database's group commit, one level up). Every caller gets
//! its own answer only after the commit that made its write durable.

use std::future::Future;
use std::sync::Arc;

use tokio::sync::{Semaphore, mpsc, oneshot};

use super::StoreError;

/// Jobs written together at most.
pub const MAX_BATCH: usize = 256;
/// Batches in flight at once per batcher (each holds one pooled connection).
/// Few writers make big batches, and Postgres spends its CPU per statement:
/// measured on 2 cores, one writer per batcher (per worker thread) served
/// more first requests than two (0.59× vs 0.56× the pgbench ceiling, three
/// rounds each in one session), and two served 20% more than four.
pub const WRITERS: usize = 1;

type Reply<R> = oneshot::Sender<Result<R, StoreError>>;

/// A queue of jobs `J` answered with `R`.
pub struct Batcher<J, R> {
    queue: mpsc::UnboundedSender<(J, Reply<R>)>,
    op: &'static str,
}

impl<J, R> Clone for Batcher<J, R> {
    fn clone(&self) -> Self {
        Batcher {
            queue: self.queue.clone(),
            op: self.op,
        }
    }
}

impl<J: Send + 'static, R: Send + 'static> Batcher<J, R> {
    /// Starts a dispatcher; `write` runs one batch and answers each job, in
    /// order.
    pub fn spawn<W, F>(op: &'static str, write: W) -> Self
    where
        W: Fn(Vec<J>) -> F + Send + Sync + 'static,
        F: Future<Output = Result<Vec<R>, StoreError>> + Send + 'static,
    {
        let (queue, mut jobs) = mpsc::unbounded_channel::<(J, Reply<R>)>();
        let writers = Arc::new(Semaphore::new(WRITERS));
        let write = Arc::new(write);
        tokio::spawn(async move {
            while let Some(first) = jobs.recv().await {
                // Wait for a free writer first: jobs that arrive meanwhile
                // join this batch.
                let Ok(writer) = writers.clone().acquire_owned().await else {
                    return;
                };
                let mut batch = vec![first];
                while batch.len() < MAX_BATCH {
                    match jobs.try_recv() {
                        Ok(job) => batch.push(job),
                        Err(_) => break,
                    }
                }
                let write = write.clone();
                tokio::spawn(async move {
                    let (jobs, replies): (Vec<_>, Vec<_>) = batch.into_iter().unzip();
                    match write(jobs).await {
                        Ok(answers) => {
                            for (reply, answer) in replies.into_iter().zip(answers) {
                                let _ = reply.send(Ok(answer));
                            }
                        }
                        Err(e) => {
                            let cause = e.to_string();
                            for reply in replies {
                                let _ = reply.send(Err(StoreError::Unavailable {
                                    op,
                                    cause: cause.clone(),
                                }));
                            }
                        }
                    }
                    drop(writer);
                });
            }
        });
        Batcher { queue, op }
    }

    /// Submits one job; resolves after its batch committed.
    pub async fn submit(&self, job: J) -> Result<R, StoreError> {
        let stopped = || StoreError::Unavailable {
            op: self.op,
            cause: "the batch writer stopped".into(),
        };
        let (reply, answer) = oneshot::channel();
        self.queue.send((job, reply)).map_err(|_| stopped())?;
        answer.await.unwrap_or_else(|_| Err(stopped()))
    }
}
