//! One channel's acknowledgements, sent in runs: an ack with `multiple`
//! settles every earlier delivery on the channel at once (AMQP 0-9-1
//! `basic.ack`), so the acks of messages whose outcomes became durable
//! together — the store records them in shared commits — cost the broker
//! one frame instead of one each.
//!
//! A run never reaches past a delivery that is not settled yet: `multiple`
//! would acknowledge it too, before its outcome is durable (or instead of
//! its requeue). Each delivery is registered when it arrives; an ack is
//! held only until the acker task next runs, then sent as part of a run
//! below the oldest unsettled delivery, or alone when it lies above one —
//! a slow message never holds back the acks of later ones. Requeues and
//! rejections go out alone, and their delivery counts as unsettled until
//! the broker has been sent them, so no run can cover them first.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use lapin::Channel;
use lapin::options::{BasicAckOptions, BasicNackOptions, BasicRejectOptions};
use tokio::sync::{Notify, oneshot};
use tokio::task::JoinHandle;

type Done = oneshot::Sender<Result<(), String>>;

/// What a settled delivery tells the broker, other than an ack.
#[derive(Debug, Clone, Copy)]
pub(super) enum Refusal {
    /// `basic.nack` with requeue: delivered again.
    Requeue,
    /// `basic.reject` without requeue: to the queue's dead-letter exchange.
    Reject,
}

#[derive(Default)]
struct Tags {
    /// Delivered, not yet acknowledged nor refused to the broker.
    unsettled: BTreeSet<u64>,
    /// Acknowledged by their handler, waiting for the acker task.
    ready: BTreeMap<u64, Done>,
    /// The session ended: nothing more is sent on this channel.
    closed: bool,
}

/// The acknowledgements of one channel (one consumer session).
pub(super) struct Acks {
    channel: Channel,
    tags: Mutex<Tags>,
    wake: Notify,
    /// The task that sends the runs; [`Acks::close`] ends it.
    sender: Mutex<Option<JoinHandle<()>>>,
}

impl Acks {
    /// The acks of `channel`, with the task that sends them (until
    /// [`Acks::close`]).
    pub(super) fn start(channel: Channel) -> Arc<Acks> {
        let acks = Arc::new(Acks {
            channel,
            tags: Mutex::new(Tags::default()),
            wake: Notify::new(),
            sender: Mutex::new(None),
        });
        let task = tokio::spawn(acks.clone().send_runs());
        *acks.sender.lock().expect("acks") = Some(task);
        acks
    }

    /// Registers a delivery as it arrives, before its handler runs.
    pub(super) fn delivered(&self, tag: u64) {
        self.tags.lock().expect("acks").unsettled.insert(tag);
    }

    /// Acknowledges `tag` (its outcome is durable), in the next run.
    pub(super) async fn ack(&self, tag: u64) -> Result<(), String> {
        let (done, sent) = oneshot::channel();
        {
            let mut tags = self.tags.lock().expect("acks");
            tags.unsettled.remove(&tag);
            if tags.closed {
                return Err(CLOSED.to_owned());
            }
            tags.ready.insert(tag, done);
        }
        self.wake.notify_one();
        sent.await.unwrap_or_else(|_| Err(CLOSED.to_owned()))
    }

    /// Ends the session's acks: those waiting, and any asked for later
    /// (a delivery still running when its channel went), fail — the broker
    /// delivers those messages again.
    pub(super) fn close(&self) {
        if let Some(task) = self.sender.lock().expect("acks").take() {
            task.abort();
        }
        let waiting = {
            let mut tags = self.tags.lock().expect("acks");
            tags.closed = true;
            std::mem::take(&mut tags.ready)
        };
        for done in waiting.into_values() {
            let _ = done.send(Err(CLOSED.to_owned()));
        }
    }

    /// Requeues or rejects `tag`, alone; it stays unsettled until sent.
    pub(super) async fn refuse(&self, tag: u64, refusal: Refusal) -> Result<(), String> {
        if self.tags.lock().expect("acks").closed {
            return Err(CLOSED.to_owned());
        }
        let sent = match refusal {
            Refusal::Requeue => {
                let requeue = BasicNackOptions {
                    requeue: true,
                    ..BasicNackOptions::default()
                };
                self.channel.basic_nack(tag, requeue).await
            }
            Refusal::Reject => {
                let reject = BasicRejectOptions { requeue: false };
                self.channel.basic_reject(tag, reject).await
            }
        };
        // Sent or not, it is no longer this channel's to acknowledge: a
        // failure means the channel is gone, and the broker delivers it
        // again.
        self.tags.lock().expect("acks").unsettled.remove(&tag);
        self.wake.notify_one();
        sent.map_err(|e| e.to_string())
    }

    /// Sends what is ready whenever woken: one `multiple` ack for every
    /// ready delivery below the oldest unsettled one, single acks above it.
    async fn send_runs(self: Arc<Self>) {
        loop {
            self.wake.notified().await;
            // Handlers whose outcomes landed in the same commit are woken
            // together: let them add their tags first.
            tokio::task::yield_now().await;
            let (run, alone) = {
                let mut tags = self.tags.lock().expect("acks");
                let oldest = tags.unsettled.first().copied().unwrap_or(u64::MAX);
                let alone = tags.ready.split_off(&oldest);
                (std::mem::take(&mut tags.ready), alone)
            };
            if let Some(&last) = run.keys().next_back() {
                let sent = self
                    .channel
                    .basic_ack(
                        last,
                        BasicAckOptions {
                            multiple: run.len() > 1,
                        },
                    )
                    .await
                    .map_err(|e| e.to_string());
                for done in run.into_values() {
                    let _ = done.send(sent.clone());
                }
            }
            for (tag, done) in alone {
                let sent = self
                    .channel
                    .basic_ack(tag, BasicAckOptions::default())
                    .await
                    .map_err(|e| e.to_string());
                let _ = done.send(sent);
            }
        }
    }
}

const CLOSED: &str = "the channel is closed; the broker delivers the message again";
