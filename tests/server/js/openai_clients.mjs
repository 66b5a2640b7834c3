// The official openai npm client against cleave's server, on every
// topology: one engine, colocated, P/D, E/P/D in one process, and three
// `cleave node` processes. The model is the project's trained shapes VLM,
// so the image caption is a real answer to check. Every topology must give
// the same texts for the same seeded requests (the topology invariant
// through HTTP).
//   node openai_clients.mjs CLEAVE LM MMPROJ IMAGE CAPTION CLUSTER_LUA
import OpenAI from 'openai';
import { readFileSync } from 'node:fs';
import { check, fail, startServe, startCluster, stopAll } from './harness.mjs';

const [cleave, model, mmproj, imagePath, caption, clusterScript] = process.argv.slice(2);
if (!clusterScript) fail('usage: openai_clients.mjs CLEAVE LM MMPROJ IMAGE CAPTION CLUSTER_LUA');
const cfg = { cleave, model, mmproj, clusterScript };
const KEY = 'sk-test-0123456789';
const ALIAS = 'shapes';
const imageUrl = `data:image/png;base64,${readFileSync(imagePath).toString('base64')}`;
const imageMessage = (text) => [{
  role: 'user',
  content: [{ type: 'image_url', image_url: { url: imageUrl } }, { type: 'text', text }],
}];

async function exercise(name, baseUrl) {
  const client = new OpenAI({ baseURL: `${baseUrl}/v1`, apiKey: KEY, maxRetries: 0, timeout: 60000 });
  const out = {};

  const models = await client.models.list();
  check(models.data.length === 1 && models.data[0].id === ALIAS, `${name}: models ${JSON.stringify(models.data)}`);

  // A plain completion, greedy.
  const c = await client.completions.create({ model: ALIAS, prompt: 'describe', max_tokens: 8, temperature: 0 });
  check(c.object === 'text_completion' && c.choices.length === 1, `${name}: completion shape`);
  check(['stop', 'length'].includes(c.choices[0].finish_reason), `${name}: finish ${c.choices[0].finish_reason}`);
  check(c.usage.completion_tokens >= 1 && c.usage.completion_tokens <= 8, `${name}: usage ${JSON.stringify(c.usage)}`);
  check(c.usage.total_tokens === c.usage.prompt_tokens + c.usage.completion_tokens, `${name}: total_tokens`);
  out.greedy = c.choices[0].text;

  // Chat with an image, not streamed: the trained model's caption.
  const chat = await client.chat.completions.create({ model: ALIAS, messages: imageMessage('describe'), temperature: 0 });
  check(chat.choices[0].message.role === 'assistant', `${name}: role`);
  check(chat.choices[0].message.content === caption,
    `${name}: caption '${chat.choices[0].message.content}', want '${caption}'`);
  check(chat.choices[0].finish_reason === 'stop', `${name}: chat finish ${chat.choices[0].finish_reason}`);

  // The same, streamed, with the usage chunk; cached_tokens from the prefix cache.
  const stream = await client.chat.completions.create({
    model: ALIAS, messages: imageMessage('describe'), temperature: 0, stream: true,
    stream_options: { include_usage: true },
  });
  let text = '';
  let usage = null;
  let role = null;
  let finish = null;
  let chunks = 0;
  for await (const chunk of stream) {
    check(chunk.object === 'chat.completion.chunk', `${name}: chunk object ${chunk.object}`);
    ++chunks;
    if (chunk.usage) {
      check(chunk.choices.length === 0, `${name}: usage chunk has choices`);
      usage = chunk.usage;
      continue;
    }
    const d = chunk.choices[0].delta;
    if (d.role) role = d.role;
    if (d.content) text += d.content;
    if (chunk.choices[0].finish_reason) finish = chunk.choices[0].finish_reason;
  }
  check(role === 'assistant' && finish === 'stop' && chunks >= 3, `${name}: stream role ${role} finish ${finish}`);
  check(text === caption, `${name}: streamed caption '${text}'`);
  check(usage && usage.completion_tokens >= 1, `${name}: stream usage ${JSON.stringify(usage)}`);
  check(usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens > 0,
    `${name}: the repeated image prompt should hit the prefix cache: ${JSON.stringify(usage)}`);

  // n = 2, sampled with a seed: two choices, the same on every topology.
  const two = await client.completions.create({
    model: ALIAS, prompt: 'how many', max_tokens: 6, temperature: 1.0, seed: 7, n: 2,
  });
  check(two.choices.length === 2 && two.choices[0].index === 0 && two.choices[1].index === 1, `${name}: n=2`);
  out.seeded = two.choices.map((x) => x.text);
  const again = await client.completions.create({
    model: ALIAS, prompt: 'how many', max_tokens: 6, temperature: 1.0, seed: 7, n: 2,
  });
  check(JSON.stringify(again.choices.map((x) => x.text)) === JSON.stringify(out.seeded), `${name}: seed not repeatable`);

  // logprobs, chat and completions.
  const lp = await client.chat.completions.create({
    model: ALIAS, messages: imageMessage('how many shapes'), temperature: 0, logprobs: true, top_logprobs: 2,
  });
  const content = lp.choices[0].logprobs.content;
  check(content.length === lp.usage.completion_tokens, `${name}: ${content.length} logprobs for ${lp.usage.completion_tokens} tokens`);
  for (const t of content) {
    check(t.logprob <= 0 && t.top_logprobs.length === 2, `${name}: logprob entry ${JSON.stringify(t)}`);
    check(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob, `${name}: top_logprobs order`);
    check(t.token === t.top_logprobs[0].token, `${name}: greedy token is the top one`);
  }
  const clp = await client.completions.create({ model: ALIAS, prompt: 'describe', max_tokens: 4, temperature: 0, logprobs: 3 });
  const L = clp.choices[0].logprobs;
  check(L.tokens.length === clp.usage.completion_tokens && L.token_logprobs.length === L.tokens.length &&
        L.top_logprobs.every((m) => Object.keys(m).length >= 1 && Object.keys(m).length <= 3),
  `${name}: completion logprobs ${JSON.stringify(L)}`);

  // Stop strings: the greedy text cut before the stop, finish_reason stop.
  if (out.greedy.length >= 4) {
    const stopAt = out.greedy.slice(2, 4);
    const s = await client.completions.create({ model: ALIAS, prompt: 'describe', max_tokens: 8, temperature: 0, stop: [stopAt] });
    check(s.choices[0].text === out.greedy.slice(0, out.greedy.indexOf(stopAt)),
      `${name}: stop '${stopAt}' gave '${s.choices[0].text}' from '${out.greedy}'`);
    check(s.choices[0].finish_reason === 'stop', `${name}: stop finish ${s.choices[0].finish_reason}`);
  }

  // A wrong key is an AuthenticationError.
  const bad = new OpenAI({ baseURL: `${baseUrl}/v1`, apiKey: 'sk-wrong', maxRetries: 0 });
  try {
    await bad.models.list();
    fail(`${name}: a wrong key was accepted`);
  } catch (e) {
    check(e instanceof OpenAI.AuthenticationError, `${name}: wrong key gave ${e.constructor.name}: ${e.message}`);
  }
  // An over-long prompt is a BadRequestError naming the context.
  try {
    await client.completions.create({ model: ALIAS, prompt: 'describe '.repeat(5000), max_tokens: 4 });
    fail(`${name}: an over-long prompt was accepted`);
  } catch (e) {
    check(e instanceof OpenAI.BadRequestError, `${name}: over-long prompt gave ${e.constructor.name}: ${e.message}`);
    check(e.code === 'context_length_exceeded', `${name}: code ${e.code}`);
  }
  return out;
}

const topologies = [
  ['mono', []],
  ['colocated', ['--topology', 'colocated', '--colocated-actors', '2']],
  ['pd', ['--topology', 'pd', '--decode-actors', '2']],
  ['epd', ['--topology', 'pd', '--vision-actors', '2']],
];
const results = {};
for (const [name, extra] of topologies) {
  const s = await startServe(cfg, ['--mmproj', mmproj, '--api-key', KEY, '-a', ALIAS, ...extra]);
  try {
    results[name] = await exercise(name, s.baseUrl);
    console.log(`ok ${name}: greedy '${results[name].greedy}', seeded ${JSON.stringify(results[name].seeded)}`);
  } catch (e) {
    console.error(`server stderr (${name}):\n${s.head.stderrText.slice(-4000)}`);
    throw e;
  } finally {
    await stopAll(s);
  }
}
{
  const s = await startCluster(cfg, { apiKey: KEY, extraHead: ['-a', ALIAS] });
  try {
    results.cluster = await exercise('cluster', s.baseUrl);
    console.log(`ok cluster: greedy '${results.cluster.greedy}', seeded ${JSON.stringify(results.cluster.seeded)}`);
  } catch (e) {
    for (const p of s.procs) console.error(`stderr of ${p.what}:\n${p.stderrText.slice(-3000)}`);
    throw e;
  } finally {
    await stopAll(s);
  }
}
for (const [name, r] of Object.entries(results)) {
  check(r.greedy === results.mono.greedy, `${name}: greedy '${r.greedy}' != mono '${results.mono.greedy}'`);
  check(JSON.stringify(r.seeded) === JSON.stringify(results.mono.seeded), `${name}: seeded texts differ from mono`);
}
console.log(`openai clients: ${Object.keys(results).length} topologies, same texts on all`);
