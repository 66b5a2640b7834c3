// OpenAI's Batch API on `cleave serve --batch-dir` and on a cluster head,
// driven by the official openai npm client: files.create, batches.create /
// retrieve / list / cancel, files.content. Every answered line equals what
// `cleave run-batch` writes for the same input (only "created" and
// cached_tokens may differ); a server killed with SIGKILL mid-batch and
// started again on the same directory finishes the batch with each
// custom_id exactly once and the same lines; a cancelled batch ends
// cancelled with a partial output; bad calls get OpenAI's errors.
//
// usage: node batch_api.mjs CLEAVE MODEL MMPROJ PNG CLUSTER_SCRIPT WORKDIR
import { spawnSync } from 'node:child_process';
import { createReadStream, mkdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import OpenAI from 'openai';
import { check, fail, startServe, startCluster, stop, stopAll } from './harness.mjs';

const [cleave, model, mmproj, png, clusterScript, work] = process.argv.slice(2);
if (!work) fail('usage: node batch_api.mjs CLEAVE MODEL MMPROJ PNG CLUSTER_SCRIPT WORKDIR');
rmSync(work, { recursive: true, force: true });
mkdirSync(work, { recursive: true });
const cfg = { cleave, model, mmproj, clusterScript };
const dataUrl = `data:image/png;base64,${readFileSync(png).toString('base64')}`;
const QUESTIONS = ['describe the picture', 'how many shapes are there', 'what color is the square', 'hello'];

// A seeded generator, so the inputs are the same every run.
function rng(seed) {
  let s = seed >>> 0;
  return () => ((s = (s * 1664525 + 1013904223) >>> 0) / 4294967296);
}

function makeInput(name, n, seed, { withCompletion = false } = {}) {
  const r = rng(seed);
  const lines = [];
  for (let i = 0; i < n; i++) {
    const q = QUESTIONS[Math.floor(r() * QUESTIONS.length)];
    const content = r() < 0.4 ? [{ type: 'image_url', image_url: { url: dataUrl } }, { type: 'text', text: q }] : q;
    const body = { messages: [{ role: 'user', content }], max_tokens: 4 + Math.floor(r() * 12) };
    if (r() < 0.5) {
      body.temperature = 0.9;
      if (r() < 0.5) body.seed = Math.floor(r() * 1e6);
    } else {
      body.temperature = 0;
    }
    lines.push(JSON.stringify({ custom_id: `${name}-${i}`, method: 'POST', url: '/v1/chat/completions', body }));
  }
  if (withCompletion)
    lines.push(JSON.stringify({ custom_id: `${name}-completion`, method: 'POST', url: '/v1/completions',
      body: { prompt: 'a small', max_tokens: 4 } }));
  const path = join(work, `${name}.jsonl`);
  writeFileSync(path, lines.join('\n') + '\n');
  return path;
}

function parseLines(text) {
  const byId = new Map();
  const counts = new Map();
  for (const raw of text.split('\n')) {
    if (!raw) continue;
    const l = JSON.parse(raw);
    delete l.response.body.created;
    if (l.response.body.usage?.prompt_tokens_details) delete l.response.body.usage.prompt_tokens_details.cached_tokens;
    counts.set(l.custom_id, (counts.get(l.custom_id) ?? 0) + 1);
    byId.set(l.custom_id, l);
  }
  return { byId, counts };
}

// What `cleave run-batch` writes for the input.
function reference(input) {
  const out = `${input}.ref.jsonl`;
  const r = spawnSync(cleave, ['run-batch', '-i', input, '-o', out, '-m', model, '--mmproj', mmproj, '-t', '1'],
    { encoding: 'utf8' });
  check(r.status === 0, `run-batch ${input}: ${r.status} ${r.stderr}`);
  return parseLines(readFileSync(out, 'utf8')).byId;
}

function compare(ref, text, what, { skip = [] } = {}) {
  const { byId, counts } = parseLines(text);
  for (const [id, k] of counts) check(k === 1, `${what}: ${id} is in the output ${k} times`);
  for (const [id, line] of ref) {
    if (skip.includes(id)) continue;
    check(byId.has(id), `${what}: ${id} is missing`);
    check(JSON.stringify(byId.get(id)) === JSON.stringify(line),
      `${what}: ${id} differs from run-batch:\n  ${JSON.stringify(line).slice(0, 400)}\n  ${JSON.stringify(byId.get(id)).slice(0, 400)}`);
  }
  return byId;
}

async function waitFor(client, id, pred, what, timeoutMs = 120000) {
  const t0 = Date.now();
  for (;;) {
    const b = await client.batches.retrieve(id);
    if (pred(b)) return b;
    if (Date.now() - t0 > timeoutMs) fail(`${what}: batch ${id} is ${b.status} ${JSON.stringify(b.request_counts)} after ${timeoutMs} ms`);
    await new Promise((r) => setTimeout(r, 20));
  }
}

async function runBatch(client, input, endpoint = '/v1/chat/completions') {
  const file = await client.files.create({ file: createReadStream(input), purpose: 'batch' });
  check(file.object === 'file' && file.purpose === 'batch' && file.bytes === readFileSync(input).length,
    `files.create: ${JSON.stringify(file)}`);
  return client.batches.create({ input_file_id: file.id, endpoint, completion_window: '24h',
    metadata: { test: 'batch_api' } });
}

async function expectError(p, status, what) {
  try {
    await p;
  } catch (e) {
    check(e.status === status, `${what}: status ${e.status}, expected ${status}: ${e.message}`);
    return e;
  }
  fail(`${what}: no error`);
}

const KEY = 'batch-key';
const extra = ['--mmproj', mmproj, '--api-key', KEY];

// 1. A batch on one process: every line as run-batch writes it.
const dir = join(work, 'serve-dir');
let s = await startServe(cfg, [...extra, '--batch-dir', dir]);
let client = new OpenAI({ baseURL: `${s.baseUrl}/v1`, apiKey: KEY, maxRetries: 0 });
const small = makeInput('small', 24, 1, { withCompletion: true });
const smallRef = reference(small);
let b = await runBatch(client, small);
check(b.object === 'batch' && b.endpoint === '/v1/chat/completions' && b.metadata.test === 'batch_api',
  `batches.create: ${JSON.stringify(b)}`);
b = await waitFor(client, b.id, (x) => x.status === 'completed', 'small');
check(b.request_counts.total === 25 && b.request_counts.completed + b.request_counts.failed === 25,
  `small: counts ${JSON.stringify(b.request_counts)}`);
let text = await (await client.files.content(b.output_file_id)).text();
const got = compare(smallRef, text, 'small', { skip: ['small-completion'] });
const mismatch = got.get('small-completion');
check(mismatch.response.status_code === 400 && mismatch.response.body.error.param === 'url',
  `a /v1/completions line in a chat batch: ${JSON.stringify(mismatch)}`);
const listed = await client.batches.list();
check(listed.data.some((x) => x.id === b.id), 'batches.list does not show the batch');
const outFile = await client.files.retrieve(b.output_file_id);
check(outFile.bytes === Buffer.byteLength(text), `the output File object: ${JSON.stringify(outFile)}`);
console.log(`serve: a batch of ${b.request_counts.total} lines completed as run-batch writes it`);

// 2. Bad calls.
await expectError(client.files.create({ file: createReadStream(small), purpose: 'fine-tune' }), 400, 'purpose fine-tune');
await expectError(client.batches.create({ input_file_id: 'file-000000000000000000000000', endpoint: '/v1/chat/completions',
  completion_window: '24h' }), 404, 'an unknown input file');
await expectError(client.batches.create({ input_file_id: b.input_file_id, endpoint: '/v1/chat/completions',
  completion_window: '48h' }), 400, 'completion_window 48h');
await expectError(client.batches.create({ input_file_id: b.input_file_id, endpoint: '/v1/embeddings',
  completion_window: '24h' }), 400, 'endpoint /v1/embeddings');
await expectError(client.batches.retrieve('batch_000000000000000000000000'), 404, 'an unknown batch');
await expectError(client.batches.cancel(b.id), 400, 'cancelling a completed batch');
const dup = join(work, 'dup.jsonl');
writeFileSync(dup, readFileSync(small, 'utf8').split('\n').slice(0, 2).concat(readFileSync(small, 'utf8').split('\n')[0]).join('\n') + '\n');
await expectError(client.files.create({ file: createReadStream(dup), purpose: 'batch' }), 400, 'duplicate custom_ids');
const noKey = new OpenAI({ baseURL: `${s.baseUrl}/v1`, apiKey: 'wrong', maxRetries: 0 });
await expectError(noKey.batches.list(), 401, 'a wrong API key');
console.log('serve: bad calls refused with OpenAI errors');

// 3. Cancel: cancelling at once, then cancelled; what finished is in the output.
const big = makeInput('big', 400, 2);
b = await runBatch(client, big);
await waitFor(client, b.id, (x) => x.request_counts.completed > 0, 'big starts');
const c = await client.batches.cancel(b.id);
check(c.status === 'cancelling' || c.status === 'cancelled', `cancel answered ${c.status}`);
b = await waitFor(client, b.id, (x) => x.status === 'cancelled', 'big cancelled');
check(b.request_counts.completed < 400 && b.cancelled_at !== null && b.cancelling_at !== null,
  `cancelled: ${JSON.stringify(b)}`);
text = await (await client.files.content(b.output_file_id)).text();
const partial = parseLines(text);
for (const [id, k] of partial.counts) check(k === 1, `cancelled: ${id} ${k} times`);
check(partial.byId.size === b.request_counts.completed + b.request_counts.failed,
  `cancelled: ${partial.byId.size} lines for counts ${JSON.stringify(b.request_counts)}`);
console.log(`serve: cancelled after ${partial.byId.size} of 400 lines`);

// 4. kill -9 mid-batch, then the same directory again: the batch goes on.
const long = makeInput('long', 300, 3);
const longRef = reference(long);
b = await runBatch(client, long);
const before = await waitFor(client, b.id, (x) => x.request_counts.completed >= 30, 'long starts');
check(before.request_counts.completed < 300, 'the long batch finished before the kill: make it longer');
await stop(s.head, 'SIGKILL');
s = await startServe(cfg, [...extra, '--batch-dir', dir]);
client = new OpenAI({ baseURL: `${s.baseUrl}/v1`, apiKey: KEY, maxRetries: 0 });
const again = await client.batches.retrieve(b.id);
check(again.request_counts.completed >= before.request_counts.completed,
  `counts went back after the restart: ${JSON.stringify(before.request_counts)} -> ${JSON.stringify(again.request_counts)}`);
b = await waitFor(client, b.id, (x) => x.status === 'completed', 'long after the restart');
check(b.cleave.runs === 2, `runs ${b.cleave.runs}`);
text = await (await client.files.content(b.output_file_id)).text();
compare(longRef, text, 'long after kill -9');
check((await client.files.retrieve(b.input_file_id)).id === b.input_file_id, 'the input file is gone after the restart');
check((await client.batches.list()).data.length === 3, 'the restarted server does not list the 3 batches');
console.log(`serve: killed at ${before.request_counts.completed}/300, restarted, completed exactly once`);

// 4b. Killed mid-batch, then started on the same directory under another
// --block-size: its remaining lines would have other bits, so the server
// refuses to start (the directory's KV tier was made for the other layout),
// in one line; started again as before, the batch completes exactly once.
const mixed = makeInput('mixed', 300, 4);
const mixedRef = reference(mixed);
b = await runBatch(client, mixed);
await waitFor(client, b.id, (x) => x.request_counts.completed >= 10, 'mixed starts');
await stop(s.head, 'SIGKILL');
let refused = '';
try {
  s = await startServe(cfg, [...extra, '--batch-dir', dir, '--block-size', '32']);
  await stopAll(s);
} catch (e) {
  refused = String(e.message);
}
check(refused.includes('stderr: cleave: error: invalid_argument: rocksdb tier') &&
  refused.includes('was made for model fingerprint') && refused.trimEnd().split('\n').length === 1,
  `started under another --block-size: ${refused || 'it served'}`);
s = await startServe(cfg, [...extra, '--batch-dir', dir]);
client = new OpenAI({ baseURL: `${s.baseUrl}/v1`, apiKey: KEY, maxRetries: 0 });
b = await waitFor(client, b.id, (x) => x.status === 'completed', 'mixed after the refused start');
compare(mixedRef, await (await client.files.content(b.output_file_id)).text(), 'mixed after a refused start');
console.log('serve: refused to continue a batch under another --block-size; as before, it completed exactly once');
await stopAll(s);

// 5. A cluster head serves the Batch API too.
const cdir = join(work, 'cluster-dir');
const cl = await startCluster(cfg, { apiKey: KEY, extraHead: ['--batch-dir', cdir] });
client = new OpenAI({ baseURL: `${cl.baseUrl}/v1`, apiKey: KEY, maxRetries: 0 });
b = await runBatch(client, small);
b = await waitFor(client, b.id, (x) => x.status === 'completed', 'cluster');
text = await (await client.files.content(b.output_file_id)).text();
compare(smallRef, text, 'cluster', { skip: ['small-completion'] });
console.log('cluster head: the batch completed as run-batch writes it');
await stopAll(cl);
console.log('OK');
