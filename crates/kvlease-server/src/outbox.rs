//! A streamed response's bytes between the producer that makes them and the socket, within a
//! bound (issue 22: clients that stop reading).
//!
//! hyper asks a body for bytes only when the socket has room. An engine does not wait: it
//! generates a request's tokens whether or not anyone reads them, into the request's channel, so
//! a client that stopped reading made the server hold its whole answer (and hold the request in
//! the engine to its last token). Here the connection's task also drives the producer when hyper
//! does not ask ([`Outbox::drive`], called by [`crate::server`] whenever the task wakes): what is
//! produced and not yet taken by hyper is counted, and past the bound the producer is dropped
//! (its engine requests abort, SPEC D4) and the connection closed.
//!
//! The producer runs on the connection's own task, woken as before by the engine's channel: the
//! path of a token gains a lock, not a task, a wake-up or an allocation.

use axum::body::{Body, Bytes, HttpBody};
use futures_util::Stream;
use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};

/// What makes a streamed body's bytes.
pub(crate) type Producer = Pin<Box<dyn Stream<Item = Bytes> + Send>>;

/// The shared half of a streamed body: the connection drives it, the body takes from it. It goes
/// with the response (an extension) to the connection, which takes it out.
#[derive(Clone)]
pub(crate) struct Outbox(Arc<Mutex<State>>);

struct State {
    /// `None` once it has ended, overflowed, or the body was dropped.
    producer: Option<Producer>,
    queue: VecDeque<Bytes>,
    /// Bytes in `queue`.
    queued: usize,
    max_bytes: usize,
    /// hyper asked the body for bytes and found none: bytes produced now are wanted at once.
    waiting: bool,
    overflowed: bool,
}

/// What driving an outbox did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Driven {
    /// Nothing hyper is waiting for.
    Idle,
    /// Bytes for a body hyper is waiting on: poll the connection again.
    Ready,
    /// More than the bound was produced and not taken: the producer is dropped, the bytes
    /// freed; close the connection. Returned once.
    Overflowed { max_bytes: usize },
}

impl Outbox {
    /// A body made by `producer`, holding at most `max_bytes` the socket has not taken (checked
    /// each time the connection drives it), and the outbox to attach to its response.
    pub(crate) fn new(producer: Producer, max_bytes: usize) -> (Body, Outbox) {
        let outbox = Outbox(Arc::new(Mutex::new(State {
            producer: Some(producer),
            queue: VecDeque::new(),
            queued: 0,
            max_bytes,
            waiting: false,
            overflowed: false,
        })));
        (Body::new(OutboxBody(outbox.clone())), outbox)
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs the producer as far as it goes without waiting, whether or not hyper wants bytes;
    /// registers `cx` to be woken when it can go further.
    pub(crate) fn drive(&self, cx: &mut Context<'_>) -> Driven {
        let mut st = self.state();
        let produced = st.pump(cx);
        if st.queued > st.max_bytes {
            st.overflow();
            return Driven::Overflowed { max_bytes: st.max_bytes };
        }
        if produced && st.waiting {
            st.waiting = false;
            return Driven::Ready;
        }
        Driven::Idle
    }
}

impl State {
    /// Moves what the producer has ready into the queue; whether anything was.
    fn pump(&mut self, cx: &mut Context<'_>) -> bool {
        let mut produced = false;
        while let Some(p) = self.producer.as_mut() {
            match p.as_mut().poll_next(cx) {
                Poll::Ready(Some(b)) => {
                    self.queued += b.len();
                    self.queue.push_back(b);
                    produced = true;
                }
                // Ended: what is queued still goes out.
                Poll::Ready(None) => self.producer = None,
                Poll::Pending => break,
            }
        }
        produced
    }

    fn overflow(&mut self) {
        self.producer = None;
        self.queue = VecDeque::new();
        self.queued = 0;
        self.overflowed = true;
    }
}

/// The body hyper polls: what the outbox holds, producing more when it holds nothing.
struct OutboxBody(Outbox);

impl HttpBody for OutboxBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        let mut st = self.0.state();
        if st.queue.is_empty() {
            st.pump(cx);
        }
        if let Some(b) = st.queue.pop_front() {
            st.queued -= b.len();
            st.waiting = false;
            return Poll::Ready(Some(Ok(http_body::Frame::data(b))));
        }
        if st.overflowed {
            return Poll::Ready(Some(Err(axum::Error::new("the client did not take the stream: over the buffer bound"))));
        }
        if st.producer.is_none() {
            return Poll::Ready(None);
        }
        st.waiting = true;
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        let st = self.0.state();
        st.producer.is_none() && st.queue.is_empty() && !st.overflowed
    }
}

impl Drop for OutboxBody {
    /// The response is done or its connection gone: the producer goes now (its engine requests
    /// abort if unfinished), not when the connection lets go of the outbox.
    fn drop(&mut self) {
        let mut st = self.0.state();
        st.producer = None;
        st.queue = VecDeque::new();
        st.queued = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::task::Waker;
    use tokio::sync::mpsc;

    fn poll_body(body: &mut Body) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        Pin::new(body).poll_frame(&mut Context::from_waker(Waker::noop()))
    }

    /// A producer that yields what is sent on the channel, and ends when it closes.
    fn channel() -> (mpsc::UnboundedSender<Bytes>, Producer) {
        let (tx, rx) = mpsc::unbounded_channel();
        (tx, Box::pin(futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|b| (b, rx)) })))
    }

    /// Issue 22: bytes produced while nobody takes them are counted; past the bound the producer
    /// is dropped (its requests abort), the bytes freed, and the body fails.
    #[tokio::test]
    async fn an_untaken_stream_overflows_and_drops_its_producer() {
        let dropped = Arc::new(AtomicBool::new(false));
        struct Flag(Arc<AtomicBool>);
        impl Drop for Flag {
            fn drop(&mut self) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let flag = Flag(dropped.clone());
        let (tx, rx) = channel();
        let producer = futures_util::StreamExt::map(rx, move |b| {
            let _ = &flag;
            b
        });
        let (mut body, outbox) = Outbox::new(Box::pin(producer), 100);
        let cx = &mut Context::from_waker(Waker::noop());
        tx.send(Bytes::from(vec![b'a'; 60])).unwrap();
        assert_eq!(outbox.drive(cx), Driven::Idle, "60 of 100 bytes held");
        tx.send(Bytes::from(vec![b'b'; 60])).unwrap();
        assert_eq!(outbox.drive(cx), Driven::Overflowed { max_bytes: 100 });
        assert!(dropped.load(Ordering::SeqCst), "the producer is dropped at once");
        assert_eq!(outbox.state().queued, 0, "what was held is freed");
        assert!(matches!(poll_body(&mut body), Poll::Ready(Some(Err(_)))), "the body fails");
    }

    /// Issue 22: a body hyper is waiting on gets what the connection drives out of the producer
    /// (`Ready`: poll again), in order, and ends when the producer does.
    #[tokio::test]
    async fn a_waiting_body_gets_what_is_driven_and_ends_with_its_producer() {
        let (tx, rx) = channel();
        let (mut body, outbox) = Outbox::new(rx, 1 << 20);
        let cx = &mut Context::from_waker(Waker::noop());
        assert!(poll_body(&mut body).is_pending());
        tx.send(Bytes::from_static(b"one")).unwrap();
        tx.send(Bytes::from_static(b"two")).unwrap();
        assert_eq!(outbox.drive(cx), Driven::Ready);
        assert_eq!(outbox.drive(cx), Driven::Idle, "nothing new");
        for want in [&b"one"[..], b"two"] {
            let Poll::Ready(Some(Ok(frame))) = poll_body(&mut body) else { panic!("a frame") };
            assert_eq!(frame.into_data().unwrap(), want);
        }
        drop(tx);
        assert!(matches!(poll_body(&mut body), Poll::Ready(None)));
        assert!(body.is_end_stream());
    }

    /// Dropping the body (response done, connection gone) drops the producer, though the
    /// connection still holds the outbox.
    #[test]
    fn dropping_the_body_drops_the_producer() {
        let (_tx, rx) = channel();
        let (body, outbox) = Outbox::new(rx, 10);
        drop(body);
        assert!(outbox.state().producer.is_none());
        assert_eq!(outbox.drive(&mut Context::from_waker(Waker::noop())), Driven::Idle);
    }
}
