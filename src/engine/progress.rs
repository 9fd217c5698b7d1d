//! Progress of long one-shot computations (a teacher or empirical flow over many latents): a bar
//! with ETA redrawn in place when stderr is a terminal; otherwise plain log lines every 10% (at
//! most one per 5 s, so short computations stay quiet) and at least every 30 s.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

pub struct Progress {
    what: String,
    total: u64,
    done: u64,
    started: Instant,
    terminal: bool,
    /// Last drawn (terminal) or logged (otherwise) moment and percentage.
    last: Instant,
    last_percent: u64,
}

impl Progress {
    pub fn new(what: &str, total: u64) -> Progress {
        let now = Instant::now();
        Progress {
            what: what.to_string(),
            total: total.max(1),
            done: 0,
            started: now,
            terminal: std::io::stderr().is_terminal(),
            last: now,
            last_percent: 0,
        }
    }

    pub fn advance(&mut self, n: u64) {
        self.done = (self.done + n).min(self.total);
        let percent = self.done * 100 / self.total;
        let now = Instant::now();
        if self.terminal {
            if now - self.last >= Duration::from_millis(200) || self.done == self.total {
                self.last = now;
                self.draw();
            }
        } else if self.done < self.total
            && ((percent >= self.last_percent + 10 && now - self.last >= Duration::from_secs(5))
                || now - self.last >= Duration::from_secs(30))
        {
            self.last = now;
            self.last_percent = percent;
            tracing::info!(
                done = self.done,
                total = self.total,
                eta = %format_secs(self.eta()),
                "{}: {percent}%",
                self.what
            );
        }
    }

    /// Seconds left at the average rate so far.
    fn eta(&self) -> f64 {
        let elapsed = self.started.elapsed().as_secs_f64();
        if self.done == 0 {
            return f64::NAN;
        }
        elapsed * (self.total - self.done) as f64 / self.done as f64
    }

    fn draw(&self) {
        const WIDTH: u64 = 30;
        let filled = (self.done * WIDTH / self.total) as usize;
        let bar = format!(
            "{}{}",
            "#".repeat(filled),
            " ".repeat(WIDTH as usize - filled)
        );
        let mut err = std::io::stderr().lock();
        let _ = write!(
            err,
            "\r{} [{bar}] {:>3}% {}/{} ETA {}  ",
            self.what,
            self.done * 100 / self.total,
            self.done,
            self.total,
            format_secs(self.eta())
        );
        let _ = err.flush();
    }

    /// Ends the bar (a newline on a terminal) and logs the total time.
    pub fn finish(self) {
        if self.terminal {
            self.draw();
            eprintln!();
        }
        tracing::info!(
            seconds = format!("{:.1}", self.started.elapsed().as_secs_f64()),
            "{}: done",
            self.what
        );
    }
}

fn format_secs(s: f64) -> String {
    if !s.is_finite() {
        return "--:--".into();
    }
    let s = s.round() as u64;
    if s >= 3600 {
        format!("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
    } else {
        format!("{:02}:{:02}", s / 60, s % 60)
    }
}

#[cfg(test)]
mod tests {
    use super::format_secs;

    #[test]
    fn eta_formats() {
        assert_eq!(format_secs(f64::NAN), "--:--");
        assert_eq!(format_secs(61.4), "01:01");
        assert_eq!(format_secs(3725.0), "1:02:05");
    }
}
