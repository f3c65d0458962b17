//! A connection's two halves: a plain TCP socket's, or those of a mutual-TLS stream over it
//! (SPEC S6, [`crate::tls`]). The plain reader keeps its zero-copy path into the arena
//! (`Rd::Plain`); under TLS the bytes are decrypted into a buffer and copied.

use std::io::{self, IoSlice};
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf, ReadHalf, WriteHalf};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

pub(super) type Tls = tokio_rustls::TlsStream<TcpStream>;

pub(super) enum Rd {
    Plain(OwnedReadHalf),
    Tls(ReadHalf<Tls>),
}

pub(super) enum Wr {
    Plain(OwnedWriteHalf),
    Tls(WriteHalf<Tls>),
}

pub(super) fn split_plain(s: TcpStream) -> (Rd, Wr) {
    let (r, w) = s.into_split();
    (Rd::Plain(r), Wr::Plain(w))
}

pub(super) fn split_tls(s: Tls) -> (Rd, Wr) {
    let (r, w) = tokio::io::split(s);
    (Rd::Tls(r), Wr::Tls(w))
}

impl AsyncRead for Rd {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Rd::Plain(r) => Pin::new(r).poll_read(cx, buf),
            Rd::Tls(r) => Pin::new(r).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Wr {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Wr::Plain(w) => Pin::new(w).poll_write(cx, buf),
            Wr::Tls(w) => Pin::new(w).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[IoSlice<'_>]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Wr::Plain(w) => Pin::new(w).poll_write_vectored(cx, bufs),
            Wr::Tls(w) => Pin::new(w).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Wr::Plain(w) => w.is_write_vectored(),
            Wr::Tls(w) => w.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Wr::Plain(w) => Pin::new(w).poll_flush(cx),
            Wr::Tls(w) => Pin::new(w).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Wr::Plain(w) => Pin::new(w).poll_shutdown(cx),
            Wr::Tls(w) => Pin::new(w).poll_shutdown(cx),
        }
    }
}
