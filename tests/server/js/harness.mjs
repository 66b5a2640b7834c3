// Starting and stopping cleave processes for the client tests: `cleave
// serve` for one process, three `cleave node` processes (head with
// --http-port) for a cluster. Ports are 0 everywhere: each process prints
// the address it took.
import { spawn } from 'node:child_process';
import { mkdtempSync, writeFileSync, readFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

export function fail(msg) {
  throw new Error(msg);
}

export function check(cond, msg) {
  if (!cond) fail(msg);
}

// Resolves with the first match of `re` on everything the process has
// printed so far (lines that came before the call count too).
function waitForLine(proc, re, what, timeoutMs = 60000) {
  return new Promise((resolve, reject) => {
    const now = proc.stdoutText.match(re);
    if (now) return resolve(now);
    const timer = setTimeout(() => {
      proc.stdout.off('data', onData);
      reject(new Error(`${what}: no line ${re} in ${timeoutMs} ms; got: ${proc.stdoutText}`));
    }, timeoutMs);
    const onData = () => {
      const m = proc.stdoutText.match(re);
      if (m) {
        clearTimeout(timer);
        proc.stdout.off('data', onData);
        resolve(m);
      }
    };
    proc.stdout.on('data', onData);
    proc.on('exit', (code) => {
      clearTimeout(timer);
      reject(new Error(`${what} exited with ${code} before ${re}; stdout: ${proc.stdoutText}; stderr: ${proc.stderrText}`));
    });
  });
}

export function startProcess(bin, args, what, env = {}) {
  const proc = spawn(bin, args, { env: { ...process.env, ...env }, stdio: ['ignore', 'pipe', 'pipe'] });
  proc.stderrText = '';
  proc.stdoutText = '';
  // Registered first, so every waitForLine sees the text of each chunk.
  proc.stdout.on('data', (d) => {
    proc.stdoutText += d.toString();
  });
  proc.stderr.on('data', (d) => {
    proc.stderrText += d.toString();
    if (proc.stderrText.length > 200000) proc.stderrText = proc.stderrText.slice(-100000);
  });
  proc.what = what;
  return proc;
}

export async function waitHealthy(baseUrl, timeoutMs = 60000) {
  const t0 = Date.now();
  for (;;) {
    try {
      const r = await fetch(`${baseUrl}/health`);
      if (r.status === 200) return;
    } catch (e) {
      // not listening yet
    }
    if (Date.now() - t0 > timeoutMs) fail(`${baseUrl}/health not 200 after ${timeoutMs} ms`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

export function stop(proc, signal = 'SIGTERM') {
  return new Promise((resolve) => {
    if (proc.exitCode !== null || proc.signalCode !== null) return resolve(proc.exitCode);
    const timer = setTimeout(() => proc.kill('SIGKILL'), 15000);
    proc.on('exit', (code) => {
      clearTimeout(timer);
      resolve(code);
    });
    proc.kill(signal);
  });
}

// One `cleave serve` process; resolves once /health is 200.
export async function startServe(cfg, extra, env = {}) {
  const args = ['serve', '-m', cfg.model, '--port', '0', '-t', '1', ...extra];
  const proc = startProcess(cfg.cleave, args, `cleave ${args.join(' ')}`, env);
  const m = await waitForLine(proc, /listening on (http:\/\/[0-9.]+:\d+)/, proc.what);
  await waitHealthy(m[1]);
  return { procs: [proc], baseUrl: m[1], head: proc };
}

// Three nodes from a topology with an encoder, a head (router, prefill, KV
// store) and a decode node; the head serves HTTP.
export async function startCluster(cfg, { decoders = 1, apiKey, extraHead = [] } = {}) {
  const dir = mkdtempSync(join(tmpdir(), 'cleave-http-cluster-'));
  const script = join(dir, 'cluster.lua');
  writeFileSync(script, readFileSync(cfg.clusterScript));
  const common = ['-m', cfg.model, '-t', '1'];
  if (cfg.mmproj) common.push('--mmproj', cfg.mmproj);
  const head = startProcess(cfg.cleave, ['node', '--topology', script, '--name', 'prefill', ...common,
    '--set', `decoders=${decoders}`, '--http-port', '0', ...(apiKey ? ['--api-key', apiKey] : []), ...extraHead],
  'head');
  const headAddr = (await waitForLine(head, /head listening on ([0-9.]+:\d+)/, 'head'))[1];
  const port = headAddr.split(':')[1];
  const http = (await waitForLine(head, /listening on (http:\/\/[0-9.]+:\d+)/, 'head http'))[1];
  const workers = [];
  for (const name of ['encoder', 'decode']) {
    const w = startProcess(cfg.cleave, ['node', '--topology', script, '--name', name, ...common,
      '--set', `decoders=${decoders}`, '--set', `prefill_port=${port}`], name);
    await waitForLine(w, /joined/, name);
    workers.push(w);
  }
  await waitHealthy(http);
  // Stages attach after "joined": wait until a request can be placed.
  const t0 = Date.now();
  for (;;) {
    const r = await fetch(`${http}/v1/completions`, {
      method: 'POST',
      headers: { 'content-type': 'application/json', ...(apiKey ? { authorization: `Bearer ${apiKey}` } : {}) },
      body: JSON.stringify({ prompt: 'describe', max_tokens: 1, temperature: 0 }),
    });
    if (r.status === 200) break;
    if (Date.now() - t0 > 60000) fail(`cluster never served a request: ${r.status} ${await r.text()}`);
    await new Promise((res) => setTimeout(res, 100));
  }
  return { procs: [head, ...workers], baseUrl: http, head, workers, dir };
}

export async function stopAll(server) {
  for (const p of server.procs.slice().reverse()) await stop(p);
}
