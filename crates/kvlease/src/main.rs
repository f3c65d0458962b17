//! The `kvlease` binary: `kvlease serve` runs one engine behind the OpenAI API, `kvlease proxy`
//! routes requests through a prefill and a decode engine as vLLM's toy proxy does, `kvlease load`
//! drives either with closed-loop HTTP load ([`load`]).
//!
//! This file only turns flags into configuration, sets up logging and signals, and prints the
//! one start-up line that scripts and tests wait for; the work is in kvlease-server and
//! kvlease-engine.

mod load;
mod sim;
mod vllm_compat;

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};
use kvlease_core::config::KvTransferConfig;
use kvlease_engine::{EngineConfig, EngineHandle, ModelConfig, TransportKind};
use kvlease_server::{Drain, HttpLimits, ProxyConfig, ServeOptions, Upstream};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

/// Environment variable holding the transfer secret when no `--kv-transfer-secret-file` is given.
const SECRET_ENV: &str = "KVLEASE_TRANSFER_SECRET";

/// How long open connections may take to finish after a shutdown signal.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Share of the machine's memory (or of the cgroup's limit) the KV pool may take.
const KV_MEMORY_SHARE: f64 = 0.8;

/// Upper bounds on sizes no deployment needs, so that a typo is refused at start-up rather than
/// found by the allocator.
const MAX_TP_SIZE: u32 = 256;
const MAX_BLOCK_SIZE: u32 = 1024;
const MAX_MODEL_LEN: u32 = 1 << 24;
const MAX_NUM_SEQS: usize = 1 << 16;
const MAX_HTTP_CONNECTIONS: usize = 1 << 20;
/// Longest HTTP timeout accepted, seconds (a day).
const MAX_HTTP_TIMEOUT: f64 = 86_400.0;

#[derive(Parser, Debug)]
#[command(name = "kvlease", version, about = "KV-cache lease renewal for disaggregated LLM serving")]
struct Cli {
    /// Log level: error, warn, info, debug or trace (logs go to stderr). Default: info; for
    /// `sim`, error (the simulated engines' own logs are in each seed's trace instead).
    #[arg(long, global = true)]
    log_level: Option<tracing::Level>,
    /// Log format: `text` (for people) or `json` (one object per line, for log pipelines; lease
    /// lines carry `request` and `lease_id` as fields).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run one engine behind the OpenAI API (P, D or both, per request's kv_transfer_params).
    Serve(Box<ServeArgs>),
    /// Route requests through a prefill engine then a decode engine (vLLM toy-proxy flags).
    Proxy(ProxyArgs),
    /// Send closed-loop load to /v1/completions and print requests/s and latency percentiles.
    Load(load::LoadArgs),
    /// Simulate fixed timeouts, vLLM's lease and kvlease's lease side by side on one seeded workload (virtual time).
    Sim(sim::SimArgs),
}

#[derive(Args, Debug)]
struct ServeArgs {
    /// vLLM's positional model (`vllm serve MODEL`): the name served, unless
    /// --served-model-name gives one. The model itself is always the synthetic one.
    #[arg(value_name = "MODEL")]
    model_tag: Option<String>,
    /// The names requests may use (`/v1/models` lists them); the first is the one answers carry.
    #[arg(long, num_args = 1.., value_name = "NAME")]
    served_model_name: Vec<String>,
    /// Require `Authorization: Bearer <key>` on `/v1/*` (else $VLLM_API_KEY, as vLLM).
    #[arg(long, value_name = "KEY")]
    api_key: Option<String>,
    /// Address the HTTP API and the KV side channel listen on (SPEC S3).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Unique engine id (default: a random UUID).
    #[arg(long)]
    engine_id: Option<String>,
    /// Port of the KV handshake side channel (0: any free port; it is advertised in kv_transfer_params).
    #[arg(long, default_value_t = 0)]
    kv_port: u16,
    /// The IP other engines reach this one at (remote_host in kv_transfer_params, and the
    /// transfer agents' address), when --host is not it (e.g. --host 0.0.0.0).
    #[arg(long, value_name = "IP")]
    advertise_host: Option<std::net::IpAddr>,
    /// vLLM's --kv-transfer-config JSON.
    #[arg(long, value_name = "JSON")]
    kv_transfer_config: Option<String>,
    /// Tensor-parallel ranks (vLLM's --tensor-parallel-size, -tp).
    #[arg(long, visible_alias = "tensor-parallel-size", default_value_t = 1)]
    tp_size: u32,
    #[arg(long, default_value_t = 1024)]
    num_gpu_blocks: u32,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    #[arg(long, default_value_t = 64)]
    max_num_seqs: usize,
    #[arg(long, default_value_t = 4096)]
    max_model_len: u32,
    /// The model name requests must use (`/v1/models` lists it), unless MODEL or
    /// --served-model-name gives one.
    #[arg(long, default_value = "kvlease-synthetic")]
    model: String,
    #[arg(long, default_value_t = 2)]
    num_layers: u32,
    #[arg(long, default_value_t = 4)]
    num_kv_heads: u32,
    #[arg(long, default_value_t = 16)]
    head_dim: u32,
    #[arg(long, default_value_t = 2)]
    dtype_bytes: u32,
    /// Emulated prefill compute per prompt token, in milliseconds.
    #[arg(long, default_value_t = 0.0)]
    prefill_ms_per_token: f64,
    /// Emulated decode compute per generated token, in milliseconds.
    #[arg(long, default_value_t = 0.0)]
    decode_ms_per_token: f64,
    /// KV transfer backend.
    #[arg(long, value_enum, default_value_t = Transport::Tcp)]
    transport: Transport,
    /// File holding the cluster's secret for signing kv_transfer_params (SPEC S1); else $KVLEASE_TRANSFER_SECRET.
    #[arg(long, value_name = "PATH")]
    kv_transfer_secret_file: Option<PathBuf>,
    /// Listen on a non-loopback --host without a cluster secret (SPEC S3): anyone who reaches the
    /// engine can then craft kv_transfer_params and handshakes. Warns at start-up; /health says so.
    #[arg(long)]
    insecure: bool,
    /// SPEC S6: this engine's certificate (PEM chain, leaf first), signed by --kv-transfer-tls-ca
    /// and naming the engine by the URI subject alternative name kvlease://engine/<engine id>.
    /// With --kv-transfer-tls-key and --kv-transfer-tls-ca the side channel and the tcp agents
    /// run mutual TLS, and a peer is the engine its certificate names, not the name it claims.
    /// --engine-id defaults to the certificate's (and must equal it). The three files are read
    /// again when one changes (checked every second); new connections use them.
    #[arg(long, value_name = "PATH", requires_all = ["kv_transfer_tls_key", "kv_transfer_tls_ca"])]
    kv_transfer_tls_cert: Option<PathBuf>,
    /// SPEC S6: the PEM private key of --kv-transfer-tls-cert.
    #[arg(long, value_name = "PATH", requires_all = ["kv_transfer_tls_cert", "kv_transfer_tls_ca"])]
    kv_transfer_tls_key: Option<PathBuf>,
    /// SPEC S6: the cluster CA (PEM) that signs every engine's --kv-transfer-tls-cert; a peer
    /// whose certificate it did not sign gets no connection.
    #[arg(long, value_name = "PATH", requires_all = ["kv_transfer_tls_cert", "kv_transfer_tls_key"])]
    kv_transfer_tls_ca: Option<PathBuf>,
    /// SPEC O1: seconds the requests in flight get to finish after SIGTERM (new ones get 503);
    /// then, or at a second SIGTERM, what is left is cut. Leases are released either way.
    #[arg(long, default_value_t = 30.0)]
    drain_timeout: f64,
    /// Test hook, hidden: wait this many milliseconds between finding a lease safe to read and
    /// reading it, so process tests can end a lease under a read. Never set in production.
    #[arg(long, hide = true, value_name = "MS")]
    debug_read_delay_ms: Option<u64>,
    /// Register this engine in etcd (its members' client URLs, comma-separated, e.g.
    /// http://10.0.0.1:2379) under a lease of --etcd-ttl, kept alive while it serves and revoked
    /// when it drains; routers started with `kvlease proxy --etcd` find it there.
    #[arg(long, value_name = "URL")]
    etcd: Option<String>,
    #[command(flatten)]
    etcd_args: EtcdArgs,
    /// Seconds the etcd lease lasts (renewed every third of it): an engine that dies without
    /// draining leaves the routing set within this.
    #[arg(long, value_name = "SECS", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=3600), requires = "etcd")]
    etcd_ttl: u64,
    #[command(flatten)]
    http: HttpArgs,
    #[command(flatten)]
    tls: TlsArgs,
    /// Bytes of a streamed answer produced and not yet taken by its client, at most: past it the
    /// stream is cut and its request aborted (a client that stopped reading).
    #[arg(long, value_name = "BYTES", default_value_t = kvlease_server::DEFAULT_MAX_BUFFERED_STREAM_BYTES as i64, allow_negative_numbers = true)]
    http_max_buffered_stream_bytes: i64,
}

impl ServeArgs {
    /// `--http-max-buffered-stream-bytes`, checked.
    fn max_buffered_stream_bytes(&self) -> Result<usize, InvalidConfig> {
        let min = kvlease_server::MIN_BUFFERED_STREAM_BYTES;
        usize::try_from(self.http_max_buffered_stream_bytes).ok().filter(|b| *b >= min).ok_or_else(|| {
            InvalidConfig(format!(
                "--http-max-buffered-stream-bytes {} must be at least {min} (one SSE chunk)",
                self.http_max_buffered_stream_bytes
            ))
        })
    }
}

/// How often --enable-ssl-refresh looks at the certificate files.
const SSL_REFRESH_EVERY: Duration = Duration::from_secs(1);

/// vLLM's HTTPS flags (uvicorn's meanings), shared by `serve` and `proxy` (SPEC S6).
#[derive(Args, Debug)]
struct TlsArgs {
    /// PEM private key of --ssl-certfile: with it, the HTTP surface speaks HTTPS only.
    #[arg(long, value_name = "PATH")]
    ssl_keyfile: Option<PathBuf>,
    /// PEM certificate chain (leaf first) the HTTP surface presents; the proxy also presents it
    /// to engines that ask for a client certificate.
    #[arg(long, value_name = "PATH")]
    ssl_certfile: Option<PathBuf>,
    /// PEM CA certificates that client certificates are checked against (with --ssl-cert-reqs 1
    /// or 2); the proxy also trusts them, and only them, for https:// engines.
    #[arg(long, value_name = "PATH")]
    ssl_ca_certs: Option<PathBuf>,
    /// Python's ssl.CERT_*: 0 asks no client certificate (the default), 1 checks one if given,
    /// 2 refuses clients without one signed by --ssl-ca-certs.
    #[arg(long, value_name = "0|1|2", allow_negative_numbers = true)]
    ssl_cert_reqs: Option<i64>,
    /// Read --ssl-certfile, --ssl-keyfile and --ssl-ca-certs again when any of them changes
    /// (checked every second); new connections use them, open ones keep theirs (the proxy's
    /// client to https:// engines too). A set that does not load is logged and the current one
    /// stays.
    #[arg(long)]
    enable_ssl_refresh: bool,
}

impl TlsArgs {
    fn flags(&self) -> kvlease_server::TlsFlags {
        kvlease_server::TlsFlags {
            keyfile: self.ssl_keyfile.clone(),
            certfile: self.ssl_certfile.clone(),
            ca_certs: self.ssl_ca_certs.clone(),
            cert_reqs: self.ssl_cert_reqs,
        }
    }

    /// Every file read and checked: refused here, naming the flag. With --enable-ssl-refresh the
    /// listener's files are watched from here on (in the runtime this is called from).
    fn load(&self) -> Result<kvlease_server::Tls, InvalidConfig> {
        let tls = kvlease_server::Tls::load(&self.flags()).map_err(|e| InvalidConfig(e.to_string()))?;
        if self.enable_ssl_refresh {
            if tls.server.is_none() {
                return Err(InvalidConfig(
                    "--enable-ssl-refresh is given without --ssl-certfile and --ssl-keyfile: there is no certificate to refresh".into(),
                ));
            }
            tls.refresh_on_change(self.flags(), SSL_REFRESH_EVERY);
        }
        Ok(tls)
    }
}

/// Where registrations live in etcd, shared by `serve` and `proxy`.
#[derive(Args, Debug)]
struct EtcdArgs {
    /// Key prefix of the registrations (one key per engine: PREFIX + engine id).
    #[arg(long, value_name = "PREFIX", default_value = kvlease_server::etcd::DEFAULT_PREFIX, requires = "etcd", value_parser = etcd_prefix)]
    etcd_prefix: String,
}

/// `--etcd-prefix`: non-empty and ending in `/`, so one cluster's prefix never matches a
/// sibling's (`/kvlease` would also watch `/kvlease-staging/...`).
fn etcd_prefix(s: &str) -> Result<String, InvalidConfig> {
    if s.is_empty() || !s.ends_with('/') {
        return Err(InvalidConfig(format!("{s:?}: a key prefix ending in '/', e.g. /kvlease/")));
    }
    Ok(s.to_string())
}

/// The HTTP listener's bounds, shared by `serve` and `proxy`.
#[derive(Args, Debug)]
struct HttpArgs {
    /// Seconds a client has to send a whole request head, from the connection opening or from
    /// its first byte after an idle spell (slowloris).
    #[arg(long, value_name = "SECS", default_value_t = 10.0, allow_negative_numbers = true)]
    http_header_timeout: f64,
    /// Seconds a client has to send a whole request body once its head is in; else 408.
    #[arg(long, value_name = "SECS", default_value_t = 30.0, allow_negative_numbers = true)]
    http_body_timeout: f64,
    /// Seconds a kept-alive connection may wait for its next request.
    #[arg(long, value_name = "SECS", default_value_t = 60.0, allow_negative_numbers = true)]
    http_idle_timeout: f64,
    /// Seconds a response may wait on a full socket with its client taking none of it; then the
    /// connection is closed and its request ends (a client that stopped reading).
    #[arg(long, value_name = "SECS", default_value_t = 30.0, allow_negative_numbers = true)]
    http_write_timeout: f64,
    /// Open HTTP connections at most. At the cap a new connection closes the idle one nearest its
    /// timeout; if every connection has a request in flight, it is answered 503.
    #[arg(long, value_name = "N", default_value_t = 1024)]
    http_max_connections: usize,
    /// Bytes buffered for request bodies still arriving, across all connections (each body's
    /// first 16 KiB aside); a body that would pass it is answered 503.
    #[arg(long, value_name = "BYTES", default_value_t = 64 << 20)]
    http_max_buffered_body_bytes: usize,
}

impl HttpArgs {
    fn limits(&self) -> Result<HttpLimits, InvalidConfig> {
        let secs = |v: f64, flag: &str| {
            if v.is_finite() && v > 0.0 && v <= MAX_HTTP_TIMEOUT {
                Ok(Duration::from_secs_f64(v))
            } else {
                Err(InvalidConfig(format!("{flag} {v} must be a number of seconds above 0 and at most {MAX_HTTP_TIMEOUT}")))
            }
        };
        if !(1..=MAX_HTTP_CONNECTIONS).contains(&self.http_max_connections) {
            return Err(InvalidConfig(format!(
                "--http-max-connections {} must be from 1 to {MAX_HTTP_CONNECTIONS}",
                self.http_max_connections
            )));
        }
        Ok(HttpLimits {
            header_timeout: secs(self.http_header_timeout, "--http-header-timeout")?,
            body_timeout: secs(self.http_body_timeout, "--http-body-timeout")?,
            idle_timeout: secs(self.http_idle_timeout, "--http-idle-timeout")?,
            write_timeout: secs(self.http_write_timeout, "--http-write-timeout")?,
            max_connections: self.http_max_connections,
            max_buffered_body_bytes: self.http_max_buffered_body_bytes,
        })
    }
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Transport {
    /// One-sided reads over TCP (tokio): kvlease's own agent, the default.
    Tcp,
    /// NIXL over UCX, as vLLM, SGLang, TensorRT-LLM and Dynamo use (needs libnixl_capi.so:
    /// scripts/install-nixl.sh, then LD_LIBRARY_PATH).
    Nixl,
}

impl From<Transport> for TransportKind {
    fn from(t: Transport) -> TransportKind {
        match t {
            Transport::Tcp => TransportKind::Tcp,
            Transport::Nixl => TransportKind::Nixl,
        }
    }
}

/// `kvlease proxy --transfer-mode`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum ProxyTransferMode {
    Learn,
    Push,
    Pull,
}

impl From<ProxyTransferMode> for kvlease_server::TransferMode {
    fn from(m: ProxyTransferMode) -> Self {
        match m {
            ProxyTransferMode::Learn => kvlease_server::TransferMode::Learn,
            ProxyTransferMode::Push => kvlease_server::TransferMode::Push,
            ProxyTransferMode::Pull => kvlease_server::TransferMode::Pull,
        }
    }
}

#[derive(Args, Debug)]
struct ProxyArgs {
    /// SPEC S3: loopback unless told otherwise. Any address is allowed without --insecure: the
    /// proxy is the port to expose; it holds no KV and no secret, and never forwards a client's
    /// kv_transfer_params to a decoder (the engines behind it keep their own rule).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    #[arg(long, num_args = 1.., default_values_t = ["localhost".to_string()])]
    prefiller_hosts: Vec<String>,
    #[arg(long, num_args = 1.., default_values_t = [8100u16])]
    prefiller_ports: Vec<u16>,
    #[arg(long, num_args = 1.., default_values_t = ["localhost".to_string()])]
    decoder_hosts: Vec<String>,
    #[arg(long, num_args = 1.., default_values_t = [8200u16])]
    decoder_ports: Vec<u16>,
    /// Route to the engines registered in etcd (its members' client URLs, comma-separated)
    /// instead of the --prefiller-* and --decoder-* lists: watched, and checked every
    /// --health-interval; the last known set is kept while etcd is unreachable (`/health` and
    /// `kvlease_proxy_etcd_up` say so).
    #[arg(long, value_name = "URL", conflicts_with_all = ["prefiller_hosts", "prefiller_ports", "decoder_hosts", "decoder_ports"])]
    etcd: Option<String>,
    /// SPEC §13: how a request's two legs go. `learn`: one after the other until a prefiller
    /// answers as a push engine (`NixlPushConnector`), then both at once to it (P with a fresh
    /// `transfer_id`, D with P's coordinates and the same id); `push`: as `learn`, and with
    /// --etcd a prefiller's coordinates come from its registration (its first request already
    /// goes at once); `pull`: always one after the other.
    #[arg(long, value_enum, default_value_t = ProxyTransferMode::Learn)]
    transfer_mode: ProxyTransferMode,
    #[command(flatten)]
    etcd_args: EtcdArgs,
    /// Seconds a request may take through the proxy, both legs and the whole answer: 504 before
    /// the first byte, an SSE error event after it.
    #[arg(long, default_value_t = 600.0)]
    request_timeout: f64,
    /// Seconds between `/health` probes of every upstream (1 s probe timeout); one that fails a
    /// probe or a connection is out of rotation until a probe succeeds.
    #[arg(long, default_value_t = 0.5)]
    health_interval: f64,
    /// SPEC O1: seconds the requests in flight get to finish after SIGTERM (new ones get 503).
    #[arg(long, default_value_t = 30.0)]
    drain_timeout: f64,
    /// Threads relaying requests. 1 (the default) runs the proxy on one thread: the least CPU a
    /// request (no hand-offs between threads), several thousand requests a second on one core;
    /// more spread the relaying over that many cores.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    threads: u16,
    #[command(flatten)]
    http: HttpArgs,
    #[command(flatten)]
    tls: TlsArgs,
}

/// A configuration refused before anything started: exit code 2, like a usage error.
#[derive(Debug)]
struct InvalidConfig(String);

impl std::fmt::Display for InvalidConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for InvalidConfig {}

fn main() -> ExitCode {
    let (argv, notes) = match vllm_compat::rewrite(std::env::args().collect()) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let cli = Cli::parse_from(argv);
    let default_level = if matches!(cli.command, Command::Sim(_)) { tracing::Level::ERROR } else { tracing::Level::INFO };
    let logs = tracing_subscriber::fmt().with_writer(std::io::stderr).with_max_level(cli.log_level.unwrap_or(default_level));
    match cli.log_format {
        LogFormat::Text => logs.init(),
        LogFormat::Json => logs.json().flatten_event(true).with_current_span(false).init(),
    }
    for note in notes {
        tracing::warn!("{note}");
    }
    if let Command::Serve(args) = &cli.command {
        if args.transport == Transport::Nixl {
            let has_secret = args.kv_transfer_secret_file.is_some() || std::env::var_os(SECRET_ENV).is_some_and(|v| !v.is_empty());
            tune_ucx(!has_secret && !args.insecure);
        }
    }
    // The load generator runs on one thread, as vLLM's benchmark client (one asyncio loop)
    // does: on a multi-threaded runtime every streamed chunk crossed threads to reach its
    // request's task, a wake-up each, and that client cost was measured as the server's
    // streaming latency (issue 15). One thread reads about 20,000 answers a second here, more
    // than the servers it measures can give on this machine.
    let runtime = match &cli.command {
        Command::Load(_) => tokio::runtime::Builder::new_current_thread().enable_all().build(),
        // The proxy too, unless told otherwise (--threads): a request's legs and its answer are
        // one task's, so nothing is gained from a second thread but wake-ups across threads
        // (issue 27: 15–30 % of its CPU a request).
        Command::Proxy(args) if args.threads == 1 => tokio::runtime::Builder::new_current_thread().enable_all().build(),
        Command::Proxy(args) => tokio::runtime::Builder::new_multi_thread().worker_threads(args.threads.into()).enable_all().build(),
        _ => tokio::runtime::Runtime::new(),
    };
    let runtime = match runtime {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Serve(args) => serve(*args).await,
            Command::Proxy(args) => proxy(args).await,
            Command::Load(args) => load::run(args).await,
            Command::Sim(args) => sim::run(args),
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            if e.downcast_ref::<InvalidConfig>().is_some() {
                ExitCode::from(2)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

/// Reads the transfer secret: the file's contents trimmed, else the environment variable.
fn transfer_secret(file: Option<&PathBuf>) -> anyhow::Result<Option<Vec<u8>>> {
    if let Some(path) = file {
        let raw = std::fs::read(path).with_context(|| format!("cannot read --kv-transfer-secret-file {}", path.display()))?;
        let secret = raw.trim_ascii().to_vec();
        if secret.is_empty() {
            return Err(InvalidConfig(format!("--kv-transfer-secret-file {} is empty", path.display())).into());
        }
        return Ok(Some(warn_if_weak(secret)));
    }
    Ok(std::env::var_os(SECRET_ENV).map(|v| v.as_encoded_bytes().trim_ascii().to_vec()).filter(|s| !s.is_empty()).map(warn_if_weak))
}

/// A secret is only as strong as it is hard to guess: whoever reaches a transfer agent's port can
/// test guesses against one handshake offline (see the README's Security model).
fn warn_if_weak(secret: Vec<u8>) -> Vec<u8> {
    const STRONG: usize = 32;
    if secret.len() < STRONG {
        tracing::warn!(
            "the cluster secret is {} bytes: use at least {STRONG} random bytes (e.g. `openssl rand -hex 32`), or it may be guessed offline",
            secret.len()
        );
    }
    secret
}

/// The names served: --served-model-name, else the positional MODEL, else --model.
fn served_names(args: &ServeArgs) -> Vec<String> {
    if !args.served_model_name.is_empty() {
        args.served_model_name.clone()
    } else {
        vec![args.model_tag.clone().unwrap_or_else(|| args.model.clone())]
    }
}

/// `--kv-port`, else vLLM's `VLLM_NIXL_SIDE_CHANNEL_PORT`, else any free port.
fn side_channel_port(flag: u16) -> Result<u16, InvalidConfig> {
    match std::env::var("VLLM_NIXL_SIDE_CHANNEL_PORT") {
        Ok(v) if flag == 0 && !v.is_empty() => {
            v.trim().parse().map_err(|_| InvalidConfig(format!("VLLM_NIXL_SIDE_CHANNEL_PORT={v:?} is not a port number")))
        }
        _ => Ok(flag),
    }
}

/// `--advertise-host`, else vLLM's `VLLM_NIXL_SIDE_CHANNEL_HOST` (an IP: the address other
/// engines reach this one's side channel and agents at).
fn side_channel_host(flag: Option<std::net::IpAddr>) -> Result<Option<std::net::IpAddr>, InvalidConfig> {
    match std::env::var("VLLM_NIXL_SIDE_CHANNEL_HOST") {
        Ok(v) if flag.is_none() && !v.is_empty() => v
            .trim()
            .parse()
            .map(Some)
            .map_err(|_| InvalidConfig(format!("VLLM_NIXL_SIDE_CHANNEL_HOST={v:?} is not an IP address (kvlease advertises an IP)"))),
        _ => Ok(flag),
    }
}

fn engine_config(args: &ServeArgs) -> anyhow::Result<EngineConfig> {
    let model = ModelConfig {
        name: served_names(args).remove(0),
        num_layers: args.num_layers,
        num_kv_heads: args.num_kv_heads,
        head_dim: args.head_dim,
        dtype_bytes: args.dtype_bytes,
        block_size: args.block_size,
        max_model_len: args.max_model_len,
        prefill_ms_per_token: args.prefill_ms_per_token,
        decode_ms_per_token: args.decode_ms_per_token,
    };
    check_sizes(args)?;
    model.validate(args.tp_size).map_err(|e| InvalidConfig(e.to_string()))?;
    if let Some(limit) = memory_limit() {
        check_kv_memory(&model, args.tp_size, args.num_gpu_blocks, limit)?;
    }
    let blocks_per_seq = args.max_model_len.div_ceil(args.block_size);
    if blocks_per_seq > args.num_gpu_blocks {
        tracing::warn!(
            "--num-gpu-blocks {} holds fewer than the {blocks_per_seq} blocks one sequence of --max-model-len {} needs: long prompts will be refused",
            args.num_gpu_blocks,
            args.max_model_len
        );
    }
    let transfer = match &args.kv_transfer_config {
        None => KvTransferConfig::default(),
        Some(json) => {
            let (cfg, warnings) = KvTransferConfig::parse(json).map_err(|e| InvalidConfig(e.to_string()))?;
            for w in warnings {
                tracing::warn!("{w}");
            }
            cfg
        }
    };
    let transfer_tls = match (&args.kv_transfer_tls_cert, &args.kv_transfer_tls_key, &args.kv_transfer_tls_ca) {
        (Some(cert), Some(key), Some(ca)) => {
            let flags = kvlease_transport::tls::TransferTlsFlags { cert: cert.clone(), key: key.clone(), ca: ca.clone() };
            let tls = kvlease_transport::tls::TransferTls::load(&flags).map_err(|e| InvalidConfig(e.to_string()))?;
            if let Some(id) = args.engine_id.as_ref().filter(|id| **id != tls.engine_id()) {
                return Err(InvalidConfig(format!(
                    "--engine-id {id:?} is not the engine --kv-transfer-tls-cert {} names ({:?}): give --engine-id {:?}, or leave it out",
                    cert.display(),
                    tls.engine_id(),
                    tls.engine_id()
                ))
                .into());
            }
            if args.transport == Transport::Nixl {
                tracing::warn!(
                    "--kv-transfer-tls-*: with --transport nixl the side channel runs mutual TLS and NIXL's notifications are bound to the certificates, but NIXL's READs and WRITEs run over UCX, unencrypted, and any agent holding our NIXL metadata can read our registered blocks (SPEC S6; P5/D6 keep such bytes from being used)"
                );
            }
            Some(tls)
        }
        // clap requires all three together.
        _ => None,
    };
    let secret = transfer_secret(args.kv_transfer_secret_file.as_ref())?;
    if secret.is_none() {
        tracing::warn!(
            "no transfer secret (--kv-transfer-secret-file or ${SECRET_ENV}): kv_transfer_params are unsigned and accepted unsigned (SPEC S1)"
        );
    }
    Ok(EngineConfig {
        engine_id: match (&args.engine_id, &transfer_tls) {
            (Some(id), _) => id.clone(),
            // SPEC S6: peers know it by its certificate.
            (None, Some(tls)) => tls.engine_id(),
            (None, None) => kvlease_server::ids::random_uuid(),
        },
        host: args.host.clone(),
        kv_port: side_channel_port(args.kv_port)?,
        advertise_host: side_channel_host(args.advertise_host)?,
        transfer,
        tp_size: args.tp_size,
        num_gpu_blocks: args.num_gpu_blocks,
        max_num_seqs: args.max_num_seqs,
        model,
        transport: args.transport.into(),
        secret,
        transfer_tls,
        debug_read_delay: args.debug_read_delay_ms.map(Duration::from_millis),
        ..EngineConfig::default()
    })
}

/// Bounds on the scheduler and model sizes (the KV pool's bytes are checked against memory).
fn check_sizes(args: &ServeArgs) -> Result<(), InvalidConfig> {
    let bounds: [(u64, u64, u64, &str); 5] = [
        (args.num_gpu_blocks.into(), 1, u32::MAX.into(), "--num-gpu-blocks"),
        (args.max_num_seqs as u64, 1, MAX_NUM_SEQS as u64, "--max-num-seqs"),
        (args.max_model_len.into(), 1, MAX_MODEL_LEN.into(), "--max-model-len"),
        (args.block_size.into(), 1, MAX_BLOCK_SIZE.into(), "--block-size"),
        (args.tp_size.into(), 1, MAX_TP_SIZE.into(), "--tp-size"),
    ];
    for (value, min, max, flag) in bounds {
        if value < min {
            return Err(InvalidConfig(format!("{flag} must be at least {min}")));
        }
        if value > max {
            return Err(InvalidConfig(format!("{flag} {value} is more than the {max} kvlease allows")));
        }
    }
    Ok(())
}

/// Refuses a KV pool larger than [`KV_MEMORY_SHARE`] of `limit` bytes: the pool is allocated at
/// start-up (every rank's arena plus the free list), and one that does not fit grows until the
/// machine kills something. Call after `model.validate`, which bounds a block.
fn check_kv_memory(model: &ModelConfig, tp_size: u32, num_gpu_blocks: u32, limit: u64) -> Result<(), InvalidConfig> {
    let heads_per_rank = model.num_kv_heads / tp_size;
    // Each rank's arena holds its heads' share of every block; the pool keeps one u32 id per block.
    let per_block = model.block_bytes(heads_per_rank) as u128 * u128::from(tp_size) + 4;
    let need = per_block * u128::from(num_gpu_blocks);
    let allowed = (limit as f64 * KV_MEMORY_SHARE) as u128;
    if need > allowed {
        return Err(InvalidConfig(format!(
            "--num-gpu-blocks {num_gpu_blocks} needs {} of KV memory ({per_block} bytes per block), more than {:.0}% of this machine's {}: lower --num-gpu-blocks (or the model geometry)",
            human_bytes(need),
            KV_MEMORY_SHARE * 100.0,
            human_bytes(limit.into())
        )));
    }
    Ok(())
}

/// The memory this process may use: the machine's total, or its cgroup's limit if lower.
/// `None` where neither can be read (not Linux).
fn memory_limit() -> Option<u64> {
    let total = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| mem_total(&m));
    let cgroup = ["/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"]
        .iter()
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .find_map(|v| v.trim().parse::<u64>().ok());
    match (total, cgroup) {
        (Some(t), Some(c)) => Some(t.min(c)),
        (t, c) => t.or(c),
    }
}

/// `MemTotal` of a `/proc/meminfo` text, in bytes.
fn mem_total(meminfo: &str) -> Option<u64> {
    let kb = meminfo.lines().find_map(|l| l.strip_prefix("MemTotal:"))?.trim().strip_suffix("kB")?.trim().parse::<u64>().ok()?;
    kb.checked_mul(1024)
}

fn human_bytes(n: u128) -> String {
    const UNITS: [&str; 6] = ["bytes", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} bytes")
    } else {
        format!("{v:.1} {} ({n} bytes)", UNITS[unit])
    }
}

/// UCX's TCP transport moves KV about twice as fast with 64 KiB segments than with its default
/// (BENCHMARKS.md). Without a cluster secret (SPEC S3), UCX, which listens on every interface
/// whatever `--host` says, is kept on loopback too. Set before any thread starts, and only where
/// the operator has not chosen.
fn tune_ucx(loopback_only: bool) {
    let mut defaults = vec![("UCX_TCP_TX_SEG_SIZE", "64k"), ("UCX_TCP_RX_SEG_SIZE", "64k")];
    if loopback_only {
        defaults.push(("UCX_NET_DEVICES", "lo"));
    }
    for (key, value) in defaults {
        if std::env::var_os(key).is_none() {
            std::env::set_var(key, value);
        }
    }
}

/// `host:port`, bracketing IPv6 literals.
fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

async fn bind(host: &str, port: u16) -> anyhow::Result<TcpListener> {
    let addr = host_port(host, port);
    kvlease_transport::listen(host, port).await.with_context(|| format!("cannot listen on {addr}"))
}

/// Prints the start-up line on stdout (tests and scripts wait for it).
fn announce(line: String) {
    let mut out = std::io::stdout().lock();
    // stdout closed is no reason to stop serving.
    let _ = writeln!(out, "{line}").and_then(|()| out.flush());
}

/// SPEC S3: without a cluster secret every listener stays on loopback, unless `--insecure`.
/// Returns whether the engine runs insecure (beyond loopback without a secret).
fn check_exposure(host: &str, bound: std::net::IpAddr, has_secret: bool, insecure: bool) -> Result<bool, InvalidConfig> {
    if has_secret || bound.to_canonical().is_loopback() {
        return Ok(false);
    }
    if !insecure {
        return Err(InvalidConfig(format!(
            "--host {host} is not a loopback address and there is no cluster secret: anyone who reaches this engine could forge kv_transfer_params and handshakes (SPEC S1, S3). \
             Give the cluster's secret with --kv-transfer-secret-file (or ${SECRET_ENV}), or pass --insecure to listen there anyway"
        )));
    }
    tracing::warn!(
        "--insecure: listening on {host} without a cluster secret; kv_transfer_params and handshakes are accepted unsigned from anyone who reaches it (SPEC S3)"
    );
    Ok(true)
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let cfg = engine_config(&args)?;
    if let Some(tls) = &cfg.transfer_tls {
        // Lives as long as the runtime: new transfer connections use the files as they are now.
        tls.refresh_on_change(SSL_REFRESH_EVERY);
    }
    let limits = args.http.limits()?;
    let max_buffered_stream_bytes = args.max_buffered_stream_bytes()?;
    let tls = args.tls.load()?.server;
    if tls.is_none() && args.tls.ssl_ca_certs.is_some() {
        return Err(InvalidConfig(
            "--ssl-ca-certs is given without --ssl-certfile and --ssl-keyfile: the HTTP surface would not speak HTTPS".into(),
        )
        .into());
    }
    let scheme = if tls.is_some() { "https" } else { "http" };
    let listener = bind(&args.host, args.port).await?;
    let http = listener.local_addr().context("listener has no address")?;
    let insecure = check_exposure(&args.host, http.ip(), cfg.secret.is_some(), args.insecure)?;
    let engine_id = cfg.engine_id.clone();
    let role = cfg.transfer.kv_role;
    let drain_timeout = seconds(args.drain_timeout, "--drain-timeout")?;
    let etcd = etcd_target(&args)?;
    let engine = EngineHandle::start(cfg).await.context("cannot start the engine")?;
    // The listener is bound: a router that finds the engine at once is answered as soon as the
    // server runs.
    let registrar =
        etcd.map(|(etcd, host)| register(etcd, (scheme, &host), &args, role, &engine_id, (http.port(), engine.kv_addr().port())));
    let signals = Signals::new();
    kvlease_server::raise_open_files_limit();
    announce(format!(
        "kvlease serve listening on {scheme}://{} (engine {engine_id}, kv side channel {})",
        host_port(&args.host, http.port()),
        engine.kv_addr()
    ));
    let drain = Arc::new(Drain::default());
    let (stopped_tx, stopped_rx) = tokio::sync::oneshot::channel::<()>();
    let api_key = args.api_key.clone().or_else(|| std::env::var("VLLM_API_KEY").ok()).filter(|k| !k.is_empty());
    let options = ServeOptions {
        http: limits,
        max_buffered_stream_bytes,
        insecure,
        drain: drain.clone(),
        served_model_names: served_names(&args),
        api_key,
        tls,
    };
    let server = kvlease_server::serve(engine.clone(), listener, options, async move {
        drain_on_signal(signals, &drain, drain_timeout, registrar).await;
        let _ = stopped_tx.send(());
    });
    run_with_grace(server, stopped_rx).await?;
    engine.shutdown().await;
    let released = engine.metrics().released(kvlease_core::lease_table::ReleaseReason::Shutdown).get();
    tracing::info!("stopped");
    announce(format!("kvlease serve stopped: {released} leases released at shutdown"));
    Ok(())
}

/// A positive number of seconds from a flag.
fn seconds(v: f64, flag: &str) -> Result<Duration, InvalidConfig> {
    if v.is_finite() && v > 0.0 && v <= 86_400.0 {
        Ok(Duration::from_secs_f64(v))
    } else {
        Err(InvalidConfig(format!("{flag} must be a number of seconds in (0, 86400], got {v}")))
    }
}

/// `--etcd`, checked before anything starts: the client, and the address to register (the
/// advertised one, else `--host`, which must then not be a wildcard).
fn etcd_target(args: &ServeArgs) -> Result<Option<(kvlease_server::etcd::Etcd, String)>, InvalidConfig> {
    let Some(url) = &args.etcd else { return Ok(None) };
    let etcd = kvlease_server::etcd::Etcd::new(url).map_err(|e| InvalidConfig(e.0))?;
    let host = match side_channel_host(args.advertise_host)? {
        Some(ip) => ip.to_string(),
        None if args.host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_unspecified()) => {
            return Err(InvalidConfig(format!(
                "--etcd: --host {} is not an address others can reach; give --advertise-host, the IP routers and engines reach this one at",
                args.host
            )))
        }
        None => args.host.clone(),
    };
    if host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback()) || host == "localhost" {
        tracing::warn!(
            "--etcd: registering {host}, a loopback address: only routers on this machine can reach it (give --host or --advertise-host the address others reach this engine at)"
        );
    }
    Ok(Some((etcd, host)))
}

/// Registers the engine in etcd under `--etcd-prefix` + engine id: its role (from `kv_role`),
/// the URL of its API (`scheme://host:port`) and its side channel at `host`, its `tp_size`.
fn register(
    etcd: kvlease_server::etcd::Etcd,
    (scheme, host): (&str, &str),
    args: &ServeArgs,
    role: kvlease_core::config::KvRole,
    engine_id: &str,
    (http_port, kv_port): (u16, u16),
) -> kvlease_server::etcd::Registrar {
    use kvlease_server::etcd::{Registrar, Registration, Role};
    let role = match role {
        kvlease_core::config::KvRole::Producer => Role::Prefill,
        kvlease_core::config::KvRole::Consumer => Role::Decode,
        kvlease_core::config::KvRole::Both => Role::Both,
    };
    let registration = Registration {
        role,
        url: format!("{scheme}://{}", host_port(host, http_port)),
        engine_id: engine_id.to_string(),
        kv_addr: host_port(host, kv_port),
        tp_size: args.tp_size,
    };
    let key = format!("{}{}", args.etcd_args.etcd_prefix, registration.engine_id);
    tracing::info!(%key, role = role.as_str(), url = %registration.url, "registering in etcd at {}", etcd.url());
    Registrar::start(etcd, key, &registration, Duration::from_secs(args.etcd_ttl))
}

/// SPEC O1: waits for SIGTERM (or SIGINT), then drains: new requests get 503 while those in
/// flight finish, until none is left, `timeout` passes, or a second signal comes. An engine
/// registered in etcd deregisters first, so routers stop picking it before it turns requests away.
async fn drain_on_signal(mut signals: Signals, drain: &Drain, timeout: Duration, registrar: Option<kvlease_server::etcd::Registrar>) {
    signals.recv().await;
    if let Some(r) = registrar {
        // Bounded: an unreachable etcd must not hold up the drain (O1), nor a second signal.
        tokio::select! {
            () = r.deregister() => {}
            () = tokio::time::sleep(Duration::from_secs(2)) => tracing::warn!("etcd: deregistering took over 2 s; draining anyway (the key expires with its lease)"),
            () = signals.recv() => {
                tracing::warn!("second signal while deregistering: cutting what is left");
                drain.start();
                return;
            }
        }
    }
    drain.start();
    tracing::info!(in_flight = drain.in_flight(), "draining: new requests get 503; waiting up to {timeout:?} for those in flight");
    tokio::select! {
        () = drain.idle() => tracing::info!("drained"),
        () = tokio::time::sleep(timeout) => tracing::warn!(in_flight = drain.in_flight(), "--drain-timeout passed: cutting what is left"),
        () = signals.recv() => tracing::warn!(in_flight = drain.in_flight(), "second signal: cutting what is left"),
    }
}

async fn proxy(args: ProxyArgs) -> anyhow::Result<()> {
    let drain = Arc::new(Drain::default());
    let drain_timeout = seconds(args.drain_timeout, "--drain-timeout")?;
    let (upstreams, membership) = match &args.etcd {
        Some(url) => {
            let etcd = kvlease_server::etcd::Etcd::new(url).map_err(|e| InvalidConfig(e.0))?;
            ((Vec::new(), Vec::new()), Some(kvlease_server::Membership { etcd, prefix: args.etcd_args.etcd_prefix.clone() }))
        }
        None => (
            (
                ProxyConfig::pair("prefiller", &args.prefiller_hosts, &args.prefiller_ports).map_err(|e| InvalidConfig(e.0))?,
                ProxyConfig::pair("decoder", &args.decoder_hosts, &args.decoder_ports).map_err(|e| InvalidConfig(e.0))?,
            ),
            None,
        ),
    };
    let cfg = ProxyConfig {
        request_timeout: seconds(args.request_timeout, "--request-timeout")?,
        health_interval: seconds(args.health_interval, "--health-interval")?,
        drain: drain.clone(),
        membership,
        tls: args.tls.load()?,
        transfer_mode: args.transfer_mode.into(),
        ..ProxyConfig::new(upstreams.0, upstreams.1)
    };
    cfg.check().map_err(|e| InvalidConfig(e.0))?;
    let scheme = if cfg.tls.server.is_some() { "https" } else { "http" };
    let limits = args.http.limits()?;
    let listener = bind(&args.host, args.port).await?;
    let http = listener.local_addr().context("listener has no address")?;
    let list = |u: &[Upstream]| u.iter().map(ToString::to_string).collect::<Vec<_>>().join(" ");
    match &cfg.membership {
        Some(m) => tracing::info!(etcd = %m.etcd.url(), prefix = %m.prefix, "routing to the engines registered in etcd"),
        None => tracing::info!(prefillers = %list(&cfg.prefillers), decoders = %list(&cfg.decoders), "routing"),
    }
    let signals = Signals::new();
    kvlease_server::raise_open_files_limit();
    announce(format!("kvlease proxy listening on {scheme}://{}", host_port(&args.host, http.port())));
    let (stopped_tx, stopped_rx) = tokio::sync::oneshot::channel::<()>();
    let server = kvlease_server::proxy(cfg, listener, limits, async move {
        drain_on_signal(signals, &drain, drain_timeout, None).await;
        let _ = stopped_tx.send(());
    });
    run_with_grace(server, stopped_rx).await
}

/// Runs the server; once the shutdown signal has come, gives open connections
/// [`SHUTDOWN_GRACE`] to finish, then stops regardless.
async fn run_with_grace(
    server: impl std::future::Future<Output = std::io::Result<()>>,
    stopped: tokio::sync::oneshot::Receiver<()>,
) -> anyhow::Result<()> {
    tokio::pin!(server);
    tokio::select! {
        r = &mut server => return r.context("HTTP server failed"),
        Ok(()) = stopped => {}
    }
    match tokio::time::timeout(SHUTDOWN_GRACE, server).await {
        Ok(r) => r.context("HTTP server failed"),
        Err(_) => {
            tracing::warn!("connections still open after {SHUTDOWN_GRACE:?}: closing them");
            Ok(())
        }
    }
}

/// SIGINT and SIGTERM, as many as come. The handlers are installed by [`Signals::new`], not at
/// the first `recv`: create it before printing the start-up line, so a signal sent right after
/// that line is never missed (and never kills the process the default way).
struct Signals {
    #[cfg(unix)]
    watched: Option<(tokio::signal::unix::Signal, tokio::signal::unix::Signal)>,
}

impl Signals {
    fn new() -> Signals {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
                (Ok(term), Ok(int)) => Signals { watched: Some((term, int)) },
                (Err(e), _) | (_, Err(e)) => {
                    tracing::warn!("cannot watch SIGTERM/SIGINT ({e}); stopping on Ctrl-C only");
                    Signals { watched: None }
                }
            }
        }
        #[cfg(not(unix))]
        Signals {}
    }

    /// The next SIGTERM or SIGINT.
    async fn recv(&mut self) {
        #[cfg(unix)]
        match &mut self.watched {
            Some((term, int)) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
            }
            None => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
        }
        tracing::info!("shutdown signal received");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    #[test]
    fn toy_proxy_flags_take_space_separated_lists() {
        let cli = Cli::try_parse_from([
            "kvlease",
            "proxy",
            "--port",
            "9000",
            "--prefiller-hosts",
            "a",
            "b",
            "--prefiller-ports",
            "1",
            "2",
            "--decoder-ports",
            "3",
        ])
        .unwrap();
        let Command::Proxy(p) = cli.command else { panic!("expected proxy") };
        assert_eq!(p.prefiller_hosts, ["a", "b"]);
        assert_eq!(p.prefiller_ports, [1, 2]);
        assert_eq!(p.decoder_hosts, ["localhost"]);
        assert_eq!(p.decoder_ports, [3]);
    }

    /// Issue 12: `--etcd` replaces the static upstream lists (given together, a usage error); a
    /// wildcard `--host` needs `--advertise-host` to register a reachable URL.
    #[test]
    fn etcd_flags_replace_static_upstreams_and_need_a_reachable_address() {
        let e = Cli::try_parse_from(["kvlease", "proxy", "--etcd", "http://e:2379", "--decoder-ports", "1"]).unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::ArgumentConflict);
        let cli = Cli::try_parse_from(["kvlease", "proxy", "--etcd", "http://e:2379"]).unwrap();
        let Command::Proxy(p) = cli.command else { panic!("expected proxy") };
        assert_eq!((p.etcd.as_deref(), p.etcd_args.etcd_prefix.as_str()), (Some("http://e:2379"), "/kvlease/"));
        // The etcd options mean nothing without --etcd: refused, not ignored.
        for args in [["kvlease", "serve", "--etcd-ttl", "5"], ["kvlease", "proxy", "--etcd-prefix", "/x/"]] {
            let e = Cli::try_parse_from(args).unwrap_err();
            assert_eq!(e.kind(), clap::error::ErrorKind::MissingRequiredArgument, "{args:?}");
        }
        let e = Cli::try_parse_from(["kvlease", "proxy", "--etcd", "http://e:2379", "--etcd-prefix", "/kvlease"]).unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::ValueValidation);
        let cli = Cli::try_parse_from(["kvlease", "serve", "--host", "0.0.0.0", "--etcd", "http://e:2379"]).unwrap();
        let Command::Serve(s) = cli.command else { panic!("expected serve") };
        assert_eq!(s.etcd_ttl, 10);
        let e = etcd_target(&s).expect_err("a wildcard host is refused");
        assert!(e.to_string().contains("--advertise-host"), "{e}");
        let cli = Cli::try_parse_from(["kvlease", "serve", "--etcd", "e:2379"]).unwrap();
        let Command::Serve(s) = cli.command else { panic!("expected serve") };
        assert!(etcd_target(&s).expect_err("not an http URL").to_string().contains("--etcd"));
        let cli = Cli::try_parse_from([
            "kvlease",
            "serve",
            "--host",
            "0.0.0.0",
            "--advertise-host",
            "10.0.0.5",
            "--etcd",
            "http://e:2379,http://f:2379",
        ])
        .unwrap();
        let Command::Serve(s) = cli.command else { panic!("expected serve") };
        let (etcd, host) = etcd_target(&s).unwrap().expect("--etcd given");
        assert_eq!((etcd.url(), host.as_str()), ("http://e:2379,http://f:2379", "10.0.0.5"));
        assert!(Cli::try_parse_from(["kvlease", "serve", "--etcd-ttl", "0"]).is_err());
    }

    #[test]
    fn serve_defaults_listen_on_loopback() {
        let cli = Cli::try_parse_from(["kvlease", "serve"]).unwrap();
        let Command::Serve(s) = cli.command else { panic!("expected serve") };
        assert_eq!((s.host.as_str(), s.port, s.kv_port, s.transport), ("127.0.0.1", 8000, 0, Transport::Tcp));
        let cfg = engine_config(&s).unwrap();
        assert_eq!(cfg.model, ModelConfig::default());
        assert_eq!(cfg.engine_id.len(), 36);
    }

    /// SPEC S3: beyond loopback (the wildcards included) only with a secret or `--insecure`.
    #[test]
    fn exposure_beyond_loopback_needs_a_secret_or_insecure() {
        let ip = |s: &str| s.parse::<std::net::IpAddr>().unwrap();
        for loopback in ["127.0.0.1", "127.1.2.3", "::1", "::ffff:127.0.0.1"] {
            assert!(!check_exposure("h", ip(loopback), false, false).unwrap(), "{loopback}");
        }
        for exposed in ["0.0.0.0", "::", "10.0.0.5", "::ffff:10.0.0.5"] {
            let e = check_exposure(exposed, ip(exposed), false, false).unwrap_err().to_string();
            assert!(e.contains("--host") && e.contains("--kv-transfer-secret-file") && e.contains("--insecure"), "{e}");
            assert!(!check_exposure(exposed, ip(exposed), true, false).unwrap(), "a secret makes it safe");
            assert!(check_exposure(exposed, ip(exposed), false, true).unwrap(), "--insecure runs insecure");
        }
    }

    /// Issue "sizes validated at start-up": the KV pool must fit in 80% of memory.
    #[test]
    fn kv_pool_must_fit_in_memory() {
        let model = ModelConfig::default();
        // 4 heads × 2 layers × 2 × 16 tokens × 16 dims × 2 bytes = 8192 bytes, + 4 for the free list.
        let gib = 1u64 << 30;
        assert!(check_kv_memory(&model, 1, 1024, gib).is_ok());
        assert!(check_kv_memory(&model, 2, 100_000, gib).is_ok(), "819 MB of 1 GiB");
        let e = check_kv_memory(&model, 2, 110_000, gib).unwrap_err().to_string();
        assert!(e.contains("--num-gpu-blocks 110000") && e.contains("901560000 bytes"), "{e}");
        let e = check_kv_memory(&model, 1, u32::MAX, 64 * gib).unwrap_err().to_string();
        assert!(e.contains("32.0 TiB"), "{e}");
        assert_eq!(mem_total("MemTotal:       24684092 kB\nMemFree: 1 kB\n"), Some(24684092 * 1024));
        assert_eq!(mem_total("nothing"), None);
    }

    #[test]
    fn http_flags_become_limits_and_bad_ones_are_usage_errors() {
        let cli = Cli::try_parse_from(["kvlease", "proxy", "--http-header-timeout", "0.5", "--http-max-connections", "7"]).unwrap();
        let Command::Proxy(p) = cli.command else { panic!("expected proxy") };
        let l = p.http.limits().unwrap();
        assert_eq!((l.header_timeout, l.max_connections), (Duration::from_millis(500), 7));
        assert_eq!(l.body_timeout, HttpLimits::default().body_timeout);
        assert_eq!(l.write_timeout, HttpLimits::default().write_timeout);
        for (flag, v) in [
            ("--http-body-timeout", "0"),
            ("--http-idle-timeout", "NaN"),
            ("--http-max-connections", "0"),
            ("--http-write-timeout", "0"),
            ("--http-write-timeout", "-1"),
            ("--http-write-timeout", "NaN"),
        ] {
            let cli = Cli::try_parse_from(["kvlease", "serve", flag, v]).unwrap();
            let Command::Serve(s) = cli.command else { panic!("expected serve") };
            assert!(s.http.limits().unwrap_err().to_string().contains(flag));
        }
        let cli = Cli::try_parse_from(["kvlease", "proxy", "--http-write-timeout", "2.5"]).unwrap();
        let Command::Proxy(p) = cli.command else { panic!("expected proxy") };
        assert_eq!(p.http.limits().unwrap().write_timeout, Duration::from_millis(2500));
    }

    /// Issue 22: the stream bound defaults to 4 MiB, and one below an SSE chunk (or negative)
    /// is refused naming the flag.
    #[test]
    fn the_stream_bound_is_checked() {
        let cli = Cli::try_parse_from(["kvlease", "serve"]).unwrap();
        let Command::Serve(s) = cli.command else { panic!("expected serve") };
        assert_eq!(s.max_buffered_stream_bytes().unwrap(), 4 << 20);
        for v in ["0", "-5", "1000"] {
            let cli = Cli::try_parse_from(["kvlease", "serve", "--http-max-buffered-stream-bytes", v]).unwrap();
            let Command::Serve(s) = cli.command else { panic!("expected serve") };
            assert!(s.max_buffered_stream_bytes().unwrap_err().to_string().contains("--http-max-buffered-stream-bytes"), "{v}");
        }
    }

    #[test]
    fn bad_geometry_and_config_are_usage_errors() {
        let cli = Cli::try_parse_from(["kvlease", "serve", "--tp-size", "3"]).unwrap();
        let Command::Serve(s) = cli.command else { panic!("expected serve") };
        let e = engine_config(&s).unwrap_err();
        assert!(e.downcast_ref::<InvalidConfig>().is_some() && e.to_string().contains("--tp-size"));
        let cli = Cli::try_parse_from(["kvlease", "serve", "--kv-transfer-config", "{nope"]).unwrap();
        let Command::Serve(s) = cli.command else { panic!("expected serve") };
        assert!(engine_config(&s).unwrap_err().downcast_ref::<InvalidConfig>().is_some());
    }
}
